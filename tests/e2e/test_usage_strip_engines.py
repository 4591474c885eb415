"""The usage event the gateway asked for is removed by reading events, not by matching vLLM's
bytes (issue 35): through real Envoy with the filters ``render`` writes (``bench.lua_strip_repro``:
the Lua strip, the SSE usage reader, and a filter that sets ``strip_usage`` from a header, as
extproc does), a stream in each engine's byte shape reaches a client that did not ask for usage
exactly as the engine sent it, less that one event; one that asked gets every byte.

The shapes, each as that engine's own serializer writes its chunks:

- vLLM: pydantic ``model_dump_json`` (no spaces; ``id, object, created, model, choices,
  usage``), ``usage`` only on the last chunk.
- llama.cpp's server: ``nlohmann::ordered_json`` in the order ``tools/server`` builds it:
  ``choices`` first, then ``created, id, model, system_fingerprint, object``, ``usage`` and
  ``timings`` on the usage chunk (the shape that leaked before: ``"choices":[]`` is followed by
  ``"created"``, not ``"usage"``).
- SGLang: ``usage: null`` on every chunk (its ``ChatCompletionStreamResponse`` always carries the
  field), the usage chunk last.
- Any engine writing JSON with spaces (Python's ``json.dumps`` defaults: ``", "`` and ``": "``),
  events ended by ``\\r\\n\\r\\n`` and a keep-alive comment (``: ping``) between them, events split
  across HTTP chunks.
- A content delta that says ``"choices":[],"usage":{`` inside its text (escaped JSON): kept.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from bench.lua_strip_repro import Upstream, repro_envoy

pytestmark = pytest.mark.e2e

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def _event(obj: dict[str, Any], *, spaces: bool = False, end: bytes = b"\n\n") -> bytes:
    text = json.dumps(obj) if spaces else json.dumps(obj, separators=(",", ":"))
    return b"data: " + text.encode() + end


def _delta(text: str) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": text}, "finish_reason": None}


DONE = b"data: [DONE]\n\n"


def vllm() -> tuple[list[bytes], bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    tokens = [_event({**head, "choices": [_delta(t)]}) for t in ("a", "b", "c")]
    usage = _event({**head, "choices": [], "usage": USAGE})
    return [*tokens, usage, DONE], usage


def llamacpp() -> tuple[list[bytes], bytes]:
    def chunk(choices: list[Any], **more: Any) -> dict[str, Any]:
        return {"choices": choices, "created": 1, "id": "chatcmpl-1", "model": "m",
                "system_fingerprint": "b1-x", "object": "chat.completion.chunk", **more}

    tokens = [_event(chunk([_delta(t)])) for t in ("a", "b", "c")]
    usage = _event(chunk([], usage=USAGE, timings={"prompt_n": 7, "predicted_n": 3,
                                                    "predicted_per_second": 41.5}))
    return [*tokens, usage, DONE], usage


def sglang() -> tuple[list[bytes], bytes]:
    head = {"id": "1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    tokens = [_event({**head, "choices": [_delta(t)], "usage": None}) for t in ("a", "b", "c")]
    usage = _event({**head, "choices": [], "usage": USAGE})
    return [*tokens, usage, DONE], usage


def spaced() -> tuple[list[bytes], bytes]:
    """JSON with spaces, CRLF event ends, a keep-alive comment, events split across chunks."""
    head = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    first = _event({**head, "choices": [_delta("a")]}, spaces=True, end=b"\r\n\r\n")
    second = _event({**head, "choices": [_delta("b")]}, spaces=True, end=b"\r\n\r\n")
    usage = _event({**head, "choices": [], "usage": USAGE}, spaces=True, end=b"\r\n\r\n")
    stream = first + b": ping\r\n\r\n" + second + usage + b"data: [DONE]\r\n\r\n"
    cut = [len(first) // 2, len(first) + 5, len(stream) - len(usage) // 2 - 14]
    parts = [stream[a:b] for a, b in zip([0, *cut], [*cut, len(stream)], strict=True)]
    return parts, usage


def lookalike() -> tuple[list[bytes], bytes]:
    """Content that spells the usage event's keys: only the real usage event goes."""
    head = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    trick = _event({**head, "choices": [_delta('{"choices":[],"usage":{"total_tokens":1}}')]})
    usage = _event({**head, "choices": [], "usage": USAGE})
    return [trick, usage, DONE], usage


SHAPES = {"/vllm": vllm(), "/llamacpp": llamacpp(), "/sglang": sglang(), "/spaced": spaced(),
          "/lookalike": lookalike()}


@pytest.fixture(scope="module")
def envoy_port() -> Iterator[int]:
    streams = {path: chunks for path, (chunks, _usage) in SHAPES.items()}
    upstream = Upstream(tokens=0, pace_ms=5, pattern="event", hold_ms=0, streams=streams)
    with repro_envoy("rendered", "rendered", upstream) as (listen, _admin, _log):
        yield listen


def _stream(port: int, path: str, strip: bool) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = json.dumps({"model": "m", "stream": True, "messages": []})
        headers = {"content-type": "application/json"}
        if strip:
            headers["x-strip-usage"] = "1"
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        assert response.status == 200
        return response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("path", list(SHAPES))
def test_a_client_that_did_not_ask_gets_the_engines_stream_less_the_usage_event(
        envoy_port: int, path: str) -> None:
    chunks, usage = SHAPES[path]
    sent = b"".join(chunks)
    assert _stream(envoy_port, path, strip=True) == sent.replace(usage, b"", 1)


@pytest.mark.parametrize("path", list(SHAPES))
def test_a_client_that_asked_gets_every_byte_and_the_usage_event_once(
        envoy_port: int, path: str) -> None:
    chunks, usage = SHAPES[path]
    received = _stream(envoy_port, path, strip=False)
    assert received == b"".join(chunks)
    assert received.count(usage) == 1
