"""Counting prompt tokens for routing and the reservation: the estimate, a real tokenizer, and
the chat-template allowance. The estimate errs high on purpose (see ``extproc/tokens.py``): a
prompt routed to a pool whose context is too small for it fails at vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.bodies import PromptParts
from extproc.tokens import (
    ESTIMATE,
    PER_MESSAGE_TOKENS,
    PER_PROMPT_TOKENS,
    EstimateCounter,
    TokenizerCounter,
    count_prompt,
    count_texts,
    counter_for,
)


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0),
    ("a", 1),
    ("abc", 1),
    ("abcd", 2),  # ceil(4 / 3)
    ("abcdef", 2),
    ("abcdefg", 3),
    ("hello world", 4),  # 11 bytes
    ("x" * 3000, 1000),
    ("é", 1),  # 2 UTF-8 bytes
    ("ééé", 2),  # 6 bytes: counted in bytes, not characters
    ("日本語", 3),  # 9 bytes
    ("日本語の", 4),  # 12 bytes
    ("🙂", 2),  # 4 bytes
    ("\ud800", 1),  # a lone surrogate (JSON allows "\ud800"): 3 bytes, no crash
    # Digits count one each (most tokenizers give each its own token): a digit string
    # cannot pass for a third of its length.
    ("1234567890", 10),
    ("a1", 2),
    ("abc 2026-12-02", 8 + 2),  # 8 digits, then 6 other bytes
])
def test_the_estimate(text: str, tokens: int) -> None:
    assert EstimateCounter().count(text) == tokens


@pytest.mark.parametrize(("parts", "tokens"), [
    (PromptParts((), 0, 0), 0),  # an empty completions prompt
    (PromptParts(("abc",), 0, 0), 1),  # completions: no template allowance
    (PromptParts(("abc", "abcd"), 0, 0), 3),  # each text rounded up on its own
    (PromptParts((), 7, 0), 7),  # token ids count one each
    (PromptParts(("abc",), 7, 0), 8),
    (PromptParts(("abc",), 0, 1), 1 + PER_PROMPT_TOKENS + PER_MESSAGE_TOKENS),
    (PromptParts(("abc", "abc"), 0, 2), 2 + PER_PROMPT_TOKENS + 2 * PER_MESSAGE_TOKENS),
    (PromptParts((), 0, 3), PER_PROMPT_TOKENS + 3 * PER_MESSAGE_TOKENS),  # empty messages
])
def test_a_prompt_with_the_estimate(parts: PromptParts, tokens: int) -> None:
    assert count_prompt(ESTIMATE, parts) == tokens


@pytest.mark.parametrize(("media", "tokens"), [
    ((0, 0, 0), 1),
    ((1, 0, 0), 1 + 1000),
    ((2, 1, 0), 1 + 2000 + 300),
    ((0, 0, 3), 1 + 3 * 5000),
])
def test_media_items_count_what_the_model_says_each_costs(media: tuple[int, int, int],
                                                          tokens: int) -> None:
    parts = PromptParts(("abc",), 0, 1, media)
    allowance = PER_PROMPT_TOKENS + PER_MESSAGE_TOKENS
    assert count_prompt(ESTIMATE, parts, (1000, 300, 5000)) == tokens + allowance


def test_many_messages_cannot_hide_tokens() -> None:
    """Splitting a prompt into many tiny messages costs more, never less: each text rounds up and
    each message carries its template allowance."""
    text = "x" * 3000
    whole = count_prompt(ESTIMATE, PromptParts((text,), 0, 1))
    split = count_prompt(ESTIMATE, PromptParts(tuple(text[i:i + 1] for i in range(3000)), 0, 3000))
    assert split > whole


def word_tokenizer(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0), ("hello", 1), ("hello world", 2), ("hello world!", 3), ("hello unknown words", 3)])
def test_a_tokenizer_json_counts_its_own_tokens(tmp_path: Path, text: str, tokens: int) -> None:
    assert TokenizerCounter(str(word_tokenizer(tmp_path))).count(text) == tokens


def test_a_configured_tokenizer_is_loaded_once_and_counts_prompts(tmp_path: Path) -> None:
    path = str(word_tokenizer(tmp_path))
    counter = counter_for(path)
    assert counter_for(path) is counter
    assert counter_for(None) is ESTIMATE
    assert count_texts(counter, ["hello world", "world !"]) == 4
    assert count_prompt(counter, PromptParts(("hello world",), 2, 1)) == (
        2 + 2 + PER_PROMPT_TOKENS + PER_MESSAGE_TOKENS)


def test_a_missing_tokenizer_file_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"No such file"):  # tokenizers raises a bare Exception
        TokenizerCounter(str(tmp_path / "missing.json"))
