"""The ratelimit package's exception tree; mapped to the wire only in ``service.py``."""

from __future__ import annotations


class RateLimitError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(RateLimitError):
    """A descriptor config (or the routing YAML behind it) is invalid.

    ``str(error)`` is ``FILE:LINE: message``, the format ``llm-sidecar check`` prints.
    """

    def __init__(self, source: str, line: int, message: str) -> None:
        self.source = source
        self.line = line
        self.message = message
        super().__init__(f"{source}:{line}: {message}")


class BackendError(RateLimitError):
    """The bucket store (Redis) failed or missed its deadline; the caller applies
    ``on_backend_error``."""


class NodeDown(BackendError):
    """A Redis Cluster master that holds some of the request's buckets is down; the others
    answer. The caller applies ``on_backend_error`` as for any backend error, but it is not a
    sign that Redis as a whole is failing, so it does not count towards the breaker."""
