"""The ratelimit package's exception tree; mapped to the wire only in ``service.py``.

Config errors are the project's one :class:`~routing.errors.ConfigError` (a descriptor file and
a routing YAML are reported the same way, one ``FILE:LINE: message`` per problem), re-exported
here so the package's errors stay in one place.
"""

from __future__ import annotations

from routing.errors import ConfigError, Problem

__all__ = ["BackendError", "ConfigError", "NodeDown", "Problem", "RateLimitError"]


class RateLimitError(Exception):
    """Base of every runtime error this package raises on purpose (config errors are
    :class:`ConfigError`, shared with the routing YAML)."""


class BackendError(RateLimitError):
    """The bucket store (Redis) failed or missed its deadline; the caller applies
    ``on_backend_error``."""


class NodeDown(BackendError):
    """A Redis Cluster master that holds some of the request's buckets is down; the others
    answer. The caller applies ``on_backend_error`` as for any backend error, but it is not a
    sign that Redis as a whole is failing, so it does not count towards the breaker."""
