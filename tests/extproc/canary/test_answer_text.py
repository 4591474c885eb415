"""The answer text the canary verdict compares, read from either answer shape."""

from __future__ import annotations

import orjson
import pytest

from extproc.canary.text import MAX_CHARS, AnswerText


def sse(*docs: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(doc) + b"\n\n" for doc in docs) + b"data: [DONE]\n\n"


def chat_chunk(text: str, index: int = 0) -> dict[str, object]:
    return {"choices": [{"index": index, "delta": {"content": text}}]}


@pytest.mark.parametrize("split", [1, 7, 10_000])
def test_a_chat_stream_in_any_chunking(split: int) -> None:
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
               chat_chunk("Hello"), chat_chunk(" there"), chat_chunk(" friend", index=1),
               {"choices": [], "usage": {"completion_tokens": 3}})
    answer = AnswerText(streamed=True)
    for start in range(0, len(body), split):
        answer.feed(body[start:start + split])
    answer.finish()
    assert answer.text == "Hello there" and answer.done and not answer.broken
    assert answer.completion_tokens == 3


def test_a_completions_stream_and_bodies() -> None:
    stream = AnswerText(streamed=True)
    stream.feed(sse({"choices": [{"index": 0, "text": "one"}]},
                    {"choices": [{"index": 0, "text": " two"}]}))
    assert stream.text == "one two"
    chat = AnswerText(streamed=False)
    chat.feed(orjson.dumps({"choices": [{"index": 0, "message": {"content": "whole"}}],
                            "usage": {"completion_tokens": 1}}))
    chat.finish()
    assert chat.text == "whole" and chat.completion_tokens == 1
    text = AnswerText(streamed=False)
    text.feed(orjson.dumps({"choices": [{"index": 0, "text": "done"}]}))
    text.finish()
    assert text.text == "done"


@pytest.mark.parametrize("body", [b"data: {not json\n\n", b"data: [1, 2]\n\n"])
def test_a_stream_that_is_not_an_answer_is_broken(body: bytes) -> None:
    answer = AnswerText(streamed=True)
    answer.feed(body)
    assert answer.broken


def test_a_body_that_is_not_json_is_broken() -> None:
    answer = AnswerText(streamed=False)
    answer.feed(b"<html>")
    answer.finish()
    assert answer.broken and answer.text == ""


def test_the_text_is_bounded() -> None:
    answer = AnswerText(streamed=True)
    answer.feed(sse(*(chat_chunk("word ") for _ in range(2000))))
    assert len(answer.text) == MAX_CHARS


@pytest.mark.parametrize("split", [1, 3, 10_000])
def test_events_ended_by_crlf_are_read_too(split: int) -> None:
    body = sse(chat_chunk("Hello"), chat_chunk(" world")).replace(b"\n", b"\r\n")
    answer = AnswerText(streamed=True)
    for start in range(0, len(body), split):
        answer.feed(body[start:start + split])
    assert answer.text == "Hello world" and answer.done  # before finish: as it streams
