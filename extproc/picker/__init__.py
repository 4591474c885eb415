"""Endpoint picking: extproc sends each request of a picker pool to the best pod from live
vLLM metrics (``clusters.X.endpoint_picker``).

``state`` (what one replica knows of each pool's pods), ``prefix`` (which pods recently served
which prompt prefixes), ``scoring`` (the scorers and their weights), ``pick`` (the decision and
the :class:`~extproc.picker.pick.EndpointPicker` extproc holds).
"""
