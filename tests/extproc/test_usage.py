from __future__ import annotations

import orjson
import pytest

from extproc.usage import MAX_JSON_BYTES, Usage, UsageMeter, tokens_to_charge


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
    assert usage == Usage(5, 2, 7, 2)
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
