"""Endpoint picking: extproc sends each request of a picker pool to the best pod from live
vLLM metrics (``clusters.X.endpoint_picker``)."""
