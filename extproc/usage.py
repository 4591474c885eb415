"""Reading token usage off a chat/completions response, streamed (SSE) or not.

Pure and incremental: feed response body chunks as Envoy passes them, ask for the result at the
end. Memory is bounded: a non-streamed body above ``MAX_JSON_BYTES`` is not kept (usage then
falls back to the request's estimate), and an SSE event above ``MAX_EVENT_BYTES`` is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from extproc.quick_init import quick_init

MAX_JSON_BYTES = 8 * 1024 * 1024
MAX_EVENT_BYTES = 1024 * 1024


@quick_init
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    streamed_tokens: int
    """Content chunks seen on an SSE stream (vLLM sends about one token per chunk)."""
    errored: bool = False
    """The body carried an OpenAI/vLLM ``error`` object (possibly mid-stream, with a 200)."""
    done: bool = False
    """An SSE stream reached ``data: [DONE]``."""


def _usage_of(doc: object) -> tuple[int | None, int | None, int | None]:
    if not isinstance(doc, dict):
        return None, None, None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None, None, None

    def number(name: str) -> int | None:
        value = usage.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
            else None

    return number("prompt_tokens"), number("completion_tokens"), number("total_tokens")


def _has_content(doc: dict[str, object]) -> bool:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str) and text:
            return True
    return False


class UsageMeter:
    """Accumulates one response; ``streaming`` is decided from its content-type."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self._buffer = bytearray()
        self._overflow = False
        self._usage: tuple[int | None, int | None, int | None] = (None, None, None)
        self.streamed_tokens = 0
        self.events = 0
        self.errored = False
        self.done = False
        """``data: [DONE]`` was seen: the SSE stream's content (and usage) is complete."""

    def feed(self, chunk: bytes) -> int:
        """Take the next body chunk; the number of content-bearing SSE events it completed."""
        if not chunk or (self._overflow and not self.streaming):
            return 0
        self._buffer += chunk
        if not self.streaming:
            if len(self._buffer) > MAX_JSON_BYTES:
                self._overflow = True
                self._buffer.clear()
            return 0
        return self._drain_events()

    def _drain_events(self) -> int:
        found = 0
        while True:
            buffer = self._buffer
            end = buffer.find(b"\n\n")
            if end < 0:
                if len(buffer) > MAX_EVENT_BYTES:
                    buffer.clear()
                return found
            event = bytes(buffer[:end])
            del buffer[:end + 2]
            found += self._event(event)

    def _event(self, event: bytes) -> int:
        for line in event.split(b"\n"):
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            if not data:
                continue
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            self.events += 1
            if "error" in doc:
                self.errored = True
            usage = _usage_of(doc)
            if usage[2] is not None:
                self._usage = usage
            if _has_content(doc):
                self.streamed_tokens += 1
                return 1
        return 0

    def finish(self) -> Usage:
        if not self.streaming and self._buffer and not self._overflow:
            try:  # orjson reads the bytearray as it is: no copy
                doc = orjson.loads(self._buffer)
            except orjson.JSONDecodeError:
                pass
            else:
                self._usage = _usage_of(doc)
                self.errored = isinstance(doc, dict) and "error" in doc
            self._buffer.clear()
        prompt, completion, total = self._usage
        return Usage(prompt, completion, total, self.streamed_tokens, self.errored, self.done)


def tokens_to_charge(usage: Usage, prompt_estimate: int, output_budget: int) -> int:
    """``usage.total_tokens``, else prompt + streamed tokens, else the request's estimate."""
    if usage.total_tokens is not None:
        return usage.total_tokens
    if usage.streamed_tokens:
        return (usage.prompt_tokens if usage.prompt_tokens is not None else prompt_estimate) \
            + usage.streamed_tokens
    return prompt_estimate + output_budget


def settled_tokens(usage: Usage, status: int) -> int | None:
    """The tokens to settle a reservation with, or None when the usage is not known.

    Known: the response's own ``usage``; an upstream error status (nothing was served: 0). Not
    known: a stream cut before its usage chunk or one that carried an error event, a body too
    big to read, a stream that ended without usage: the reservation stands, so a client cannot
    lower its charge by breaking its own response. Content chunks are never counted instead:
    a chunk may carry several tokens (vLLM's ``--stream-interval``, speculative decoding), and
    reasoning or tool-call deltas carry none of ``content``. Every stream a limit charges asks
    vLLM for its usage chunk (``stream_options.include_usage``).
    """
    if status >= 400:
        return 0
    if usage.errored:
        return None
    return usage.total_tokens


_USAGE_EVENT = re.compile(rb'data: \{[^\n]*?"choices":\[\],"usage":\{[^\n]*\n\n')
"""vLLM's usage chunk: no choices, a usage object (``"choices":[]`` never occurs inside an
escaped content string). The same pattern as Envoy's Lua strip (:mod:`routing.render.usage`)."""


class UsageStripper:
    """Takes the usage chunk extproc asked vLLM for out of a stream whose client did not, where
    no Envoy filter does it (an Istio EnvoyFilter, or ``telemetry.envoy_usage: false``).

    Passes only whole events (ended by their blank line): a chunk's unfinished tail is held
    back until the next chunk completes it, and dropped at the end of the stream, as every SSE
    client drops it. vLLM writes whole events, so the hold is rare.
    """

    def __init__(self) -> None:
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes | None:
        """What to send on instead of ``chunk``; None: ``chunk`` unchanged."""
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._carry = data
            return b""
        whole, self._carry = data[:end + 2], data[end + 2:]
        if b'"choices":[],"usage":{' in whole:
            whole = _USAGE_EVENT.sub(b"", whole)
        return None if whole == chunk else whole
