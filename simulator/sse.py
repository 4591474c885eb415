"""Server-sent event chunks, as current vLLM streams chat and text completions.

Wire form: each event is ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n``.

Chat (``chat_completion_stream_generator``, chunks dumped with ``exclude_unset``): the first
chunks, one per choice (``n``), carry ``delta: {"role": "assistant", "content": ""}``; each token
then has a chunk with ``delta: {"content": ...}`` and its choice's ``index``; a choice's last
token's chunk also carries ``finish_reason`` and ``stop_reason``. Token chunks have no ``usage``
key at all (not ``null``) unless ``continuous_usage_stats`` is set, in which case every chunk
carries the usage so far. With ``include_usage`` a final chunk has ``choices: []`` and the total
``usage`` (dumped with ``exclude_none``, so no null fields).

Text completions (``completion_stream_generator``): no role chunk; each token has a chunk whose
choice carries ``index`` (prompt ``i``'s choice ``j`` is ``i * n + j``), ``text``,
``logprobs``, ``finish_reason`` and ``stop_reason``; usage rules as for chat.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from simulator.responses import ResponseMeta, Usage

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


_LLAMACPP_ORDER = ("choices", "created", "id", "model", "system_fingerprint", "object", "usage",
                   "timings")


def engine_event(payload: Mapping[str, Any], engine: str) -> bytes:
    """``payload`` (a chunk as vLLM writes it) as ``engine``'s server writes that chunk, the way
    ``llm-sidecar sim --engine`` streams (what the gateway must understand of each; facts from
    each engine's source, no code):

    - ``llamacpp``: its server builds chunks as ``nlohmann::ordered_json`` in the order
      ``choices, created, id, model, system_fingerprint, object`` (``tools/server``), the usage
      chunk with ``usage`` then ``timings`` after them: ``"choices":[]`` is followed by
      ``"created"``, not by ``"usage"``.
    - ``sglang``: its ``ChatCompletionStreamResponse`` always carries ``usage``: ``null`` on
      every chunk but the usage one.
    - ``vllm``, ``tgi``, ``trtllm``: vLLM's shape (TGI's and Triton's OpenAI front ends write
      the same keys in the same compact JSON).
    """
    if engine == "llamacpp":
        chunk = dict(payload)
        chunk["system_fingerprint"] = "b1-sim"
        if "usage" in chunk:
            usage = chunk["usage"]
            chunk["timings"] = {"prompt_n": usage.get("prompt_tokens", 0),
                                "predicted_n": usage.get("completion_tokens", 0)}
        ordered = {key: chunk[key] for key in _LLAMACPP_ORDER if key in chunk}
        return sse_event(ordered)
    if engine == "sglang" and "usage" not in payload:
        return sse_event({**payload, "usage": None})
    return sse_event(payload)


def chat_role_chunk(meta: ResponseMeta, usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
    """The opening chat chunk that announces the assistant role (one per choice)."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, "chat.completion.chunk", [choice], usage)


def chat_token_chunk(
    meta: ResponseMeta, text: str, finish_reason: str | None, usage: Usage | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A chat chunk with one token of choice ``index``; ``finish_reason`` set only on its last
    token."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    return _chunk(meta, "chat.completion.chunk", [choice], usage)


def completion_token_chunk(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A text-completion chunk with one token of the prompt at ``index``."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    return _chunk(meta, "text_completion", [choice], usage)


def usage_chunk(meta: ResponseMeta, object_type: str, usage: Usage) -> dict[str, Any]:
    """The final ``include_usage`` chunk: no choices, the request's total usage."""
    return {
        "id": meta.id,
        "object": object_type,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage.to_dict(details=False),
    }


def _chunk(
    meta: ResponseMeta, object_type: str, choices: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": meta.id,
        "object": object_type,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage.to_dict(details=False)
    return chunk
