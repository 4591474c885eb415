"""The text of an answer as it streams by, for the canary verdict's comparison.
Pure: bytes in, text out (docs: Canary verdict).

Reads an OpenAI-style answer of either shape: a stream of ``data:`` events (chat chunks'
``choices[0].delta.content``, completions' ``choices[0].text``) or one JSON body (chat's
``choices[0].message.content``, completions' ``choices[0].text``). Only the first choice is
kept (a shadow replays ``n`` as sent, and the first answers are the ones compared), and only
its first :data:`MAX_CHARS` characters: the comparison's cost grows with the product of the
two lengths.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_CHARS = 4000
"""Characters of each answer compared (about 600 words)."""
MAX_BUFFER = 1 << 20
"""Bytes of a non-streamed body (or of one unfinished event) kept before giving up on it."""


class AnswerText:
    """Feed the response body's chunks; :attr:`text` is the first choice's text so far, and
    :attr:`broken` says the body could not be read as an answer (the pair is then dropped)."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self._parts: list[str] = []
        self._size = 0
        self._pending = b""
        self._body: list[bytes] = []
        """A non-streamed body's chunks, joined once at :meth:`finish`."""
        self._held = 0
        self.broken = False
        self.done = False
        self.completion_tokens: int | None = None
        """From the answer's ``usage``, when it carried one."""

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def chars(self) -> int:
        """Characters of text so far (without joining them)."""
        return self._size

    def feed(self, chunk: bytes) -> None:
        if self.broken or self.done:
            return
        if not self.streamed:  # one JSON body: read at :meth:`finish`
            self._held += len(chunk)
            if self._held > MAX_BUFFER:
                self.broken = True
                self._body = []
                return
            self._body.append(chunk)
            return
        # SSE ends an event with a blank line, written \n\n (vLLM) or \r\n\r\n (others): one
        # form here, on what is pending only (a \r\n split between chunks meets up in it).
        pending = self._pending + chunk
        if b"\r" in pending:
            pending = pending.replace(b"\r\n", b"\n")
        *events, self._pending = pending.split(b"\n\n")
        if len(self._pending) > MAX_BUFFER:
            self.broken = True
            self._pending = b""
            return
        for event in events:
            self._event(event)

    def finish(self) -> None:
        """The body ended: read what is left."""
        if self.broken or self.done:
            return
        if self.streamed:
            rest, self._pending = self._pending, b""
            if rest.strip():
                self._event(rest)
            return
        rest, self._body = b"".join(self._body), []
        try:
            doc = orjson.loads(rest)
        except orjson.JSONDecodeError:
            self.broken = True
            return
        self._choice(doc, "message")
        self.done = True

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                self.broken = True
                return
            self._choice(doc, "delta")

    def _choice(self, doc: Any, key: str) -> None:
        if not isinstance(doc, dict):
            self.broken = True
            return
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices:
            return  # a usage-only chunk
        first = choices[0]
        if not isinstance(first, dict) or first.get("index", 0) != 0:
            return
        text = first.get("text")
        part = first.get(key)
        if isinstance(part, dict):
            text = part.get("content")
        if isinstance(text, str) and text and self._size < MAX_CHARS:
            text = text[:MAX_CHARS - self._size]
            self._parts.append(text)
            self._size += len(text)
