"""Prompt shapes and how many tokens they count.

Without a tokenizer the count is a deterministic estimate: a text is ``ceil(utf8 bytes / 4)``
tokens (so any non-empty text is at least 1), and a chat prompt adds a fake chat template of 4
tokens per message plus 3 for the assistant turn it opens. Token-id prompts count their ids.

With a ``tokenizer.json`` the texts are counted by the real tokenizer (no special tokens added) and
the same fake template overhead is added for chat, because a bare ``tokenizer.json`` carries no chat
template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_FOR_REPLY = 3


@dataclass(frozen=True)
class ChatMessage:
    """One chat message reduced to what is counted: its role and its text pieces."""

    role: str
    texts: tuple[str, ...]


@dataclass(frozen=True)
class ChatPrompt:
    """The messages of one chat completion request."""

    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids."""

    ids: tuple[int, ...]


Prompt = str | TokenPrompt | ChatPrompt
"""A text prompt, a token-id prompt, or a chat conversation."""


class TextTokenizer(Protocol):
    """Counts the tokens of a text."""

    def count(self, text: str) -> int:
        """Number of tokens ``text`` encodes to."""
        ...

    def ids(self, text: str) -> list[int]:
        """The token ids of ``text`` (``len(ids(text)) == count(text)``)."""
        ...


def estimate_text_tokens(text: str) -> int:
    """The heuristic count: ``ceil(len(utf8) / 4)``; 0 only for the empty text."""
    return (len(text.encode("utf-8")) + 3) // 4


def count_prompt_tokens(prompt: Prompt, tokenizer: TextTokenizer | None = None) -> int:
    """Tokens ``prompt`` occupies in the context window (see module docstring)."""
    if isinstance(prompt, TokenPrompt):
        return len(prompt.ids)
    count = tokenizer.count if tokenizer is not None else estimate_text_tokens
    if isinstance(prompt, str):
        return count(prompt)
    template = CHAT_TOKENS_PER_MESSAGE * len(prompt.messages) + CHAT_TOKENS_FOR_REPLY
    return template + sum(count(text) for message in prompt.messages for text in message.texts)


class FileTokenizer:
    """A ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file."""

    def __init__(self, path: str) -> None:
        """Load ``path``; ``ValueError`` when it is missing or not a tokenizer."""
        # Imported here so the heuristic path never pays for loading the Rust extension.
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file not found: {path}")
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # the extension raises a bare Exception for bad files
            raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc

    def count(self, text: str) -> int:
        """Tokens of ``text`` without special tokens."""
        return len(self.ids(text))

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
