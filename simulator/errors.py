"""Errors the simulator answers with, in current vLLM's wire shape.

Current vLLM (``ErrorResponse``/``ErrorInfo`` in ``vllm/entrypoints/openai/engine/protocol.py``,
filled by ``OpenAIServing.create_error_response``) answers every error as::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

``type`` is an exception-like name (``BadRequestError``, ``NotFoundError``) and ``code`` is the HTTP
status as an integer. vLLM before the 2025 protocol rework sent a flat
``{"object": "error", "message", "type", "param", "code"}`` instead; we follow the current one,
which is also the nesting the ``openai`` SDK and this project's contract (section 6) read.

Validation failures that vLLM raises as ``VLLMValidationError`` carry a parameter and a value, and
``str()`` of that exception appends ``" (parameter=..., value=...)"`` to the message; the simulator
reproduces that suffix so clients that parse vLLM's text keep working.
"""

from __future__ import annotations

from typing import Any


class SimError(Exception):
    """A request the simulator refuses; holds everything the HTTP answer needs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body vLLM sends for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> SimError:
    """A plain 400, as vLLM answers malformed or mistyped fields."""
    return SimError(400, message, param=param)


def validation_error(message: str, param: str, value: object = None) -> SimError:
    """A 400 worded like vLLM's ``VLLMValidationError``: message plus a parameter/value suffix."""
    extras = [f"parameter={param}"]
    if value is not None:
        extras.append(f"value={value}")
    return SimError(400, f"{message} ({', '.join(extras)})", param=param)


def model_not_found(model: str) -> SimError:
    """vLLM's 404 for a model name it does not serve."""
    return SimError(
        404,
        f"The model `{model}` does not exist.",
        err_type="NotFoundError",
        param="model",
    )


def context_length_exceeded(max_model_len: int, prompt_tokens: int, output_tokens: int) -> SimError:
    """vLLM's 400 when prompt plus requested output do not fit ``--max-model-len``.

    Wording of current vLLM's renderer (``output_tokens`` is 0 for embeddings, and 1 for a
    generation that set no ``max_tokens``, the least it must produce). vLLM stops tokenizing one
    token past the limit, hence its "at least"; the simulator knows the exact count and reports it.
    """
    total = prompt_tokens + output_tokens
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{output_tokens} output tokens and your prompt contains at least {prompt_tokens} input "
        f"tokens, for a total of at least {total} tokens. Please reduce the length of the input "
        f"prompt or the number of requested output tokens."
    )
    return validation_error(message, "input_tokens", prompt_tokens)


def route_error(reason: str) -> dict[str, Any]:
    """Body for a path or method the server does not have; FastAPI's shape, as vLLM sends it."""
    return {"detail": reason}


def internal_error() -> SimError:
    """A 500 for a simulator bug; never used for bad input."""
    return SimError(500, "Internal server error", err_type="InternalServerError")


def engine_dead() -> SimError:
    """The 500 every generation gets while ``POST /sim/state`` says ``fail_requests`` (vLLM's
    answer once its engine core has died)."""
    return SimError(500, "EngineCore encountered an issue. See stack trace (above) for the "
                    "root cause.", err_type="InternalServerError")


def metrics_failure() -> SimError:
    """The 500 a metrics endpoint answers while ``POST /sim/state`` makes it fail."""
    return SimError(500, "Metrics are failing (simulated).", err_type="InternalServerError")
