"""The ratelimit package's exceptions, in one place; mapped to the wire only in ``service.py``.

Config errors are the project's one :class:`~routing.errors.ConfigError` (a descriptor file and
a routing YAML are reported the same way, one ``FILE:LINE: message`` per problem). Backend
errors are the runtime's (:mod:`sidecar_runtime.redis.shield`), shared with extproc's cache: the
bucket store failed, missed its deadline or was skipped, and the caller applies
``on_backend_error``; a :class:`NodeDown` (one Redis Cluster master) does not count towards
the breaker. A request above one of the bounds of :mod:`ratelimit.request_bounds` is an
:class:`OutOfBounds`, which the service answers ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from routing.errors import ConfigError, Problem
from sidecar_runtime.redis.shield import BackendError, NodeDown

__all__ = ["BackendError", "ConfigError", "NodeDown", "OutOfBounds", "Problem"]


class OutOfBounds(Exception):
    """A request exceeds a bound of :mod:`ratelimit.request_bounds`; the message names the
    bound and its value (what the client is told)."""
