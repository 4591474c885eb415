"""gRPC status codes and the client's one error type, with grpcio's mapping of HTTP/2 errors
(``RST_STREAM`` codes, HTTP statuses without ``grpc-status``) to them, as its C core does
(``src/core/lib/transport/status_conversion.cc``).

Our own enum, not ``grpc.StatusCode``: the client (:mod:`.client`) needs nothing from grpcio.
"""

from __future__ import annotations

import enum
from urllib.parse import unquote

from sidecar_runtime.h2grpc import frames as f


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcError(Exception):
    """A call that did not end with an OK answer: its status ``code`` and ``details``.

    ``retryable``: the server never saw the call (refused, or above a GOAWAY's last stream), so
    sending it again cannot apply it twice."""

    def __init__(self, code: StatusCode, details: str, *, retryable: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retryable = retryable


_RST_CODES = {
    f.REFUSED_STREAM: StatusCode.UNAVAILABLE,
    f.CANCEL: StatusCode.CANCELLED,
    f.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
    0xC: StatusCode.PERMISSION_DENIED,  # INADEQUATE_SECURITY
}
_HTTP_STATUSES = {
    "400": StatusCode.INTERNAL,
    "401": StatusCode.UNAUTHENTICATED,
    "403": StatusCode.PERMISSION_DENIED,
    "404": StatusCode.UNIMPLEMENTED,
    "429": StatusCode.UNAVAILABLE,
    "502": StatusCode.UNAVAILABLE,
    "503": StatusCode.UNAVAILABLE,
    "504": StatusCode.UNAVAILABLE,
}


def reset_error(code: int) -> RpcError:
    """The error of a call whose stream the server reset with ``code``."""
    status = _RST_CODES.get(code, StatusCode.INTERNAL)
    return RpcError(status, f"the server reset the stream (HTTP/2 error {code:#x})",
                    retryable=code == f.REFUSED_STREAM)


def http_error(status: str) -> RpcError:
    """The error of an answer that is not gRPC: HTTP ``status`` without ``grpc-status``."""
    return RpcError(_HTTP_STATUSES.get(status, StatusCode.UNKNOWN),
                    f"the server answered HTTP {status or '(no :status)'}, not gRPC")


def from_trailers(fields: dict[str, str]) -> RpcError | None:
    """The error ``grpc-status`` and ``grpc-message`` (percent-encoded) name; None for OK."""
    raw = fields.get("grpc-status")
    if raw is None:
        return RpcError(StatusCode.INTERNAL, "the answer ended without grpc-status")
    if not raw.isascii() or not raw.isdigit():
        return RpcError(StatusCode.UNKNOWN, f"a grpc-status that is not a number: {raw[:20]!r}")
    number = int(raw)
    if number == 0:
        return None
    try:
        code = StatusCode(number)
    except ValueError:
        code = StatusCode.UNKNOWN
    return RpcError(code, unquote(fields.get("grpc-message", ""), errors="replace"))
