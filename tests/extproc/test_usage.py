from __future__ import annotations

import orjson
import pytest

from extproc.usage import (
    MAX_JSON_BYTES,
    Usage,
    UsageMeter,
    UsageStripper,
    settled_tokens,
    tokens_to_charge,
)


def sse(*docs: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(d) + b"\n\n" for d in docs) + b"data: [DONE]\n\n"


def delta(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_sse_usage_chunk_wins() -> None:
    body = sse(delta(""), delta("a"), delta("b"),
               {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                         "total_tokens": 7}})
    meter = UsageMeter(streaming=True)
    for i in range(0, len(body), 7):  # events split across chunks anywhere
        meter.feed(body[i:i + 7])
    usage = meter.finish()
    assert usage == Usage(5, 2, 7, 2, done=True)
    assert tokens_to_charge(usage, 100, 100) == 7


def test_sse_without_usage_counts_content_chunks() -> None:
    meter = UsageMeter(streaming=True)
    meter.feed(sse(delta("x"), delta("y"), delta("z")))
    usage = meter.finish()
    assert usage.total_tokens is None and usage.streamed_tokens == 3
    assert tokens_to_charge(usage, 10, 256) == 13


def test_completions_stream_text_counts() -> None:
    meter = UsageMeter(streaming=True)
    meter.feed(sse({"choices": [{"text": "hi"}]}, {"choices": [{"text": ""}]}))
    assert meter.finish().streamed_tokens == 1


def test_json_body_usage() -> None:
    meter = UsageMeter(streaming=False)
    raw = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                 "total_tokens": 3}})
    meter.feed(raw[:5])
    meter.feed(raw[5:])
    assert meter.finish().total_tokens == 3


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"usage": {"total_tokens": -1}}',
                                 b'{"usage": "x"}', b""])
def test_unreadable_usage_falls_back_to_the_estimate(raw: bytes) -> None:
    meter = UsageMeter(streaming=False)
    meter.feed(raw)
    assert tokens_to_charge(meter.finish(), 10, 5) == 15


def test_oversized_bodies_are_not_kept() -> None:
    meter = UsageMeter(streaming=False)
    meter.feed(b"x" * (MAX_JSON_BYTES + 1))
    meter.feed(b'{"usage": {"total_tokens": 3}}')
    assert meter.finish().total_tokens is None


def test_garbage_sse_lines_are_skipped() -> None:
    meter = UsageMeter(streaming=True)
    meter.feed(b"event: ping\n\ndata: {broken\n\n: comment\n\n" + sse(delta("a")))
    assert meter.finish().streamed_tokens == 1


def test_done_marks_the_stream_complete() -> None:
    meter = UsageMeter(streaming=True)
    meter.feed(b"data: " + orjson.dumps(delta("a")) + b"\n\n")
    assert not meter.done
    meter.feed(b"data: [DONE]\n\n")
    assert meter.done and meter.finish().streamed_tokens == 1


CUT = b"data: " + orjson.dumps(delta("a")) + b"\n\n" + b"data: " + orjson.dumps(delta("b")) + b"\n\n"
WITH_USAGE = sse(delta("a"), {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                                      "total_tokens": 6}})
ERRORED = sse(delta("a"), {"error": {"message": "engine died", "code": 500}})


@pytest.mark.parametrize(("body", "streamed", "status", "expected"), [
    (WITH_USAGE, True, 200, 6),                      # the usage chunk
    # [DONE] without usage: unknown. Content chunks are never counted in its place: one chunk
    # may hold several tokens, and reasoning or tool-call deltas hold no content.
    (sse(delta("x"), delta("y")), True, 200, None),
    (CUT, True, 200, None),                          # cut before [DONE]: unknown
    (ERRORED, True, 200, None),                      # a mid-stream error: unknown
    (b'{"usage": {"total_tokens": 9}}', False, 200, 9),
    (b'{"choices": []}', False, 200, None),          # no usage in a JSON body: unknown
    (b'{"error": {"message": "bad"}}', False, 400, 0),  # vLLM refused it: nothing served
    (b"", False, 503, 0),
])
def test_settled_tokens_only_when_usage_is_known(body: bytes, streamed: bool, status: int,
                                                 expected: int | None) -> None:
    """A reservation is settled with known usage only; a client cannot lower its charge by
    cutting its own stream."""
    meter = UsageMeter(streaming=streamed)
    meter.feed(body)
    assert settled_tokens(meter.finish(), status) == expected


TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"\\"choices\\":[]"}}]}\n\n'
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"total_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def stripped(chunks: list[bytes]) -> bytes:
    """What the client receives through a stripper fed ``chunks``."""
    stripper = UsageStripper()
    out = b""
    for chunk in chunks:
        sent = stripper.feed(chunk)
        out += chunk if sent is None else sent
    return out


@pytest.mark.parametrize("cut", [1, 10, len(TOKEN), len(TOKEN) + 5, len(TOKEN) + len(USAGE) - 1,
                                 len(TOKEN) + len(USAGE) + 1])
def test_the_usage_event_is_taken_out_wherever_the_chunks_are_cut(cut: int) -> None:
    whole = TOKEN + USAGE + DONE
    assert stripped([whole[:cut], whole[cut:]]) == TOKEN + DONE
    assert stripped([whole[i:i + 7] for i in range(0, len(whole), 7)]) == TOKEN + DONE


def test_a_stream_without_usage_passes_unchanged_and_an_unended_tail_is_dropped() -> None:
    stripper = UsageStripper()
    assert stripper.feed(TOKEN) is None and stripper.feed(DONE) is None
    assert stripped([TOKEN, b"data: {\"partial"]) == TOKEN  # as an SSE client drops it
