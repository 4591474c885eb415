"""The errors extproc answers clients with, OpenAI-shaped (docs: Errors), mapped in one place."""

from __future__ import annotations

import orjson

# The embedding cache's store errors are the runtime's, shared with the rate limiter: the
# request bypasses the cache; a NodeDown (one Redis Cluster master) does not count towards the
# cache's breaker.
from sidecar_runtime.redis.shield import BackendError as BackendError
from sidecar_runtime.redis.shield import NodeDown as NodeDown
from sidecar_runtime.wire.names import QUEUED_HEADER


class ClientError(Exception):
    """A request the sidecar refuses; carries the HTTP status and OpenAI ``type``/``code``."""

    def __init__(self, status: int, code: str, message: str, *,
                 type: str = "invalid_request_error", param: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.headers = headers
        """Sent besides ``content-type`` (a 503's ``retry-after``)."""
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str, param: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API returns it."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ClientError:
    return ClientError(400, code, message, param=param)


MAX_WRITABLE_DEPTH = 255
"""orjson reads JSON nested up to 1,024 levels but writes at most 255."""


def too_deeply_nested() -> ClientError:
    return bad_request(f"The request body is nested more than {MAX_WRITABLE_DEPTH} levels deep; "
                       "the gateway cannot pass it on.", code="invalid_json")


def client_error_of(exc: Exception) -> ClientError | None:
    """The client's fault behind ``exc``, if it is one: a field of its body nested deeper than
    any value the gateway can write back (a rewritten body, a counted ``tools`` schema, a cache
    key) fails where it is written, whichever step that is."""
    if isinstance(exc, ClientError):
        return exc
    if isinstance(exc, TypeError) and "Recursion limit reached" in str(exc):
        return too_deeply_nested()
    return None


def model_not_found(model: str) -> ClientError:
    return ClientError(404, "model_not_found",
                       f"The model `{model}` does not exist or you do not have access to it.",
                       param="model")


def context_length_exceeded(model: str, limit: int, requested: int, prompt: int,
                            output: int) -> ClientError:
    if requested > prompt + output:  # the client's X-Context-Length asked for more
        return ClientError(
            413, "context_length_exceeded",
            f"This model's maximum context length is {limit} tokens. However, the "
            f"X-Context-Length header asks for {requested} tokens ({prompt} in the prompt, "
            f"{output} for the completion). Please send a smaller X-Context-Length, or none.",
            param="X-Context-Length",
        )
    return ClientError(
        413, "context_length_exceeded",
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{requested} tokens ({prompt} in the prompt, {output} for the completion). "
        "Please reduce the length of the prompt or completion.",
        param="messages",
    )


def unsupported_content_encoding(encoding: str) -> ClientError:
    return ClientError(415, "unsupported_content_encoding",
                       f"Request bodies with content-encoding {encoding!r} are not supported; "
                       "send the JSON uncompressed.", param="content-encoding")


def unsupported_media_type() -> ClientError:
    return ClientError(415, "unsupported_media_type",
                       "Unsupported Media Type: Only 'application/json' is allowed; send the "
                       "body with content-type: application/json.", param="content-type")


def invalid_api_key() -> ClientError:
    return ClientError(401, "invalid_api_key",
                       "Incorrect or missing API key. Send it as Authorization: Bearer KEY.")


def unknown_path(method: str, path: str) -> ClientError:
    return ClientError(404, "unknown_url", f"Unrecognized request URL ({method} {path}).")


def method_not_allowed(method: str, path: str) -> ClientError:
    return ClientError(405, "method_not_allowed", f"{method} is not allowed on {path}.")




def flow_refused(cluster: str, reason: str, retry_after_s: int, waited_s: float) -> ClientError:
    """503 for a request that waited for a pod with room and got none (docs: Flow control):
    ``max_wait`` passed, or the queue was full (``max_queue``) and this was the newest of its
    lowest band."""
    if reason == "max_queue":
        why = (f"Every server of the pool `{cluster}` is busy and its waiting line is full; "
               "this request was the newest of the lowest priority waiting.")
    else:
        why = (f"Every server of the pool `{cluster}` stayed busy for as long as a request may "
               "wait.")
    return ClientError(503, "server_overloaded", f"{why} Retry later.", type="server_error",
                       headers=(("retry-after", str(retry_after_s)),
                                (QUEUED_HEADER, str(round(waited_s * 1000)))))


def server_overloaded(cluster: str, retry_after_s: int) -> ClientError:
    """503 for a low-priority request to a pool whose every pod is saturated (docs: Errors)."""
    return ClientError(503, "server_overloaded",
                       f"Every server of the pool `{cluster}` is saturated; low-priority requests "
                       "are shed until it drains. Retry later, or send a smaller request.",
                       type="server_error", headers=(("retry-after", str(retry_after_s)),))
