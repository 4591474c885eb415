"""Canary releases: the guard that trips a canary on its error rate, the comparison report read
from the metrics, and the ``llm-sidecar canary`` command that prints it."""
