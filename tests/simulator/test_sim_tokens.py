"""Token counting: the heuristic, chat template overhead, token ids, and a real tokenizer file."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from simulator.tokens import (
    ChatMessage,
    ChatPrompt,
    FileTokenizer,
    TokenPrompt,
    count_prompt_tokens,
    estimate_text_tokens,
)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("abcdefgh", 2),
        ("é", 1),  # 2 UTF-8 bytes
        ("日本語", 3),  # 9 UTF-8 bytes
        ("x" * 4000, 1000),
    ],
)
def test_text_estimate_is_ceil_of_utf8_bytes_over_four(text: str, tokens: int) -> None:
    assert estimate_text_tokens(text) == tokens
    assert count_prompt_tokens(text) == tokens


@pytest.mark.parametrize(
    ("messages", "tokens"),
    [
        # 4 per message + 3 for the reply + the texts' estimates
        ((ChatMessage("user", ("hello",)),), 4 + 3 + 2),
        ((ChatMessage("system", ("abcd",)), ChatMessage("user", ("abcdefgh",))), 8 + 3 + 1 + 2),
        ((ChatMessage("assistant", ()),), 4 + 3),
        ((ChatMessage("user", ("ab", "cd")),), 4 + 3 + 1 + 1),
    ],
)
def test_chat_adds_a_fake_template(messages: tuple[ChatMessage, ...], tokens: int) -> None:
    assert count_prompt_tokens(ChatPrompt(messages)) == tokens


@pytest.mark.parametrize(("ids", "tokens"), [((1,), 1), ((5, 6, 7), 3), (tuple(range(100)), 100)])
def test_token_prompts_count_their_ids(ids: tuple[int, ...], tokens: int) -> None:
    assert count_prompt_tokens(TokenPrompt(ids)) == tokens


def _word_tokenizer(path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    file = path / "tokenizer.json"
    tokenizer.save(str(file))
    return file


def test_a_tokenizer_file_counts_real_tokens(tmp_path: Path) -> None:
    tokenizer = FileTokenizer(str(_word_tokenizer(tmp_path)))
    assert count_prompt_tokens("hello world hello", tokenizer) == 3
    chat = ChatPrompt((ChatMessage("user", ("hello world",)),))
    assert count_prompt_tokens(chat, tokenizer) == 4 + 3 + 2


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "tokenizer file not found"), ("not json", "cannot load tokenizer")],
)
def test_a_bad_tokenizer_file_is_a_value_error(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        FileTokenizer(str(path))
