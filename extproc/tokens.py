"""Counting prompt tokens: a real ``tokenizer.json`` when configured, else an estimate.

The estimate errs high on purpose (a prompt routed to a pool too small for it fails at vLLM):
one token per digit and per 3 UTF-8 bytes of other text, plus a chat-template allowance per
message. BPE tokenizers of Llama-class models average about 4 bytes per token on English prose,
so the estimate runs ~33% high there; code sits nearer 3 bytes per token; most tokenizers
(Llama 2, Mistral, Qwen, DeepSeek) give each digit a token of its own, where 3 bytes a token
would count a digit string a third of what vLLM does (Llama 3 groups three); CJK text is
about 3 bytes per character and usually one or two tokens per character, where the estimate can
run low — configure the model's tokenizer when that matters.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Protocol

from extproc.bodies import PromptParts

BYTES_PER_TOKEN = 3
PER_MESSAGE_TOKENS = 8
"""Allowance for a chat template's role markers per message (Llama-2's ``[INST]`` and kin)."""
PER_PROMPT_TOKENS = 8
"""Allowance for BOS and the assistant prefix once per chat prompt."""


class Counter(Protocol):
    def count(self, text: str) -> int: ...


_DIGITS = b"0123456789"


class EstimateCounter:
    """One token per ASCII digit, plus ceil(other UTF-8 bytes / 3); pure and fast (two C passes
    over the text's bytes: ~1 ns a byte)."""

    def count(self, text: str) -> int:
        raw = text.encode("utf-8", "surrogatepass")
        rest = len(raw.translate(None, _DIGITS))
        return len(raw) - rest + -(-rest // BYTES_PER_TOKEN)


class TokenizerCounter:
    """Counts with a Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # cold path: only when a model names a tokenizer

        self._tokenizer = Tokenizer.from_file(path)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


ESTIMATE = EstimateCounter()


@lru_cache(maxsize=32)
def counter_for(tokenizer_path: str | None) -> Counter:
    """The counter for a model's ``tokenizer`` setting (loaded once per path)."""
    if tokenizer_path is None:
        return ESTIMATE
    return TokenizerCounter(tokenizer_path)


def count_texts(counter: Counter, texts: Iterable[str]) -> int:
    return sum(counter.count(text) for text in texts)


def count_prompt(counter: Counter, prompt: PromptParts,
                 media_tokens: tuple[int, int, int] = (0, 0, 0)) -> int:
    """One prompt's tokens: its texts, its token ids, the chat-template allowance, and its
    media items at ``media_tokens`` each (image, audio, video: the model's ``media_tokens``)."""
    tokens = count_texts(counter, prompt.texts) + prompt.token_ids
    if prompt.messages:
        tokens += PER_PROMPT_TOKENS + PER_MESSAGE_TOKENS * prompt.messages
    if prompt.media != (0, 0, 0):
        tokens += sum(items * each for items, each in zip(prompt.media, media_tokens,
                                                          strict=True))
    return tokens
