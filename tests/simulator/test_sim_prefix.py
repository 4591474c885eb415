"""The prefix cache: block hashing of prompts, how much a hit covers, LRU bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from simulator.prefix import (
    PrefixCache,
    block_hashes,
    prompt_blocks,
    token_stream,
    usable_blocks,
)
from simulator.tokens import (
    ChatMessage,
    ChatPrompt,
    FileTokenizer,
    Prompt,
    TokenPrompt,
    count_prompt_tokens,
)


def _ids(start: int, count: int) -> TokenPrompt:
    return TokenPrompt(tuple(range(start, start + count)))


def _chat(*texts: str) -> ChatPrompt:
    return ChatPrompt(tuple(ChatMessage("user" if i % 2 else "system", (t,)) for i, t in enumerate(texts)))


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "a",
        "abcd",
        "abcde",
        "héllo wörld, ünïcode",
        _ids(0, 37),
        _chat("You are helpful.", "hello"),
        ChatPrompt((ChatMessage("user", ("two", "parts")),)),
    ],
)
def test_the_hashed_stream_has_one_unit_per_counted_token(prompt: Prompt) -> None:
    assert len(token_stream(prompt)) == 4 * count_prompt_tokens(prompt)


@pytest.mark.parametrize(
    ("prompt_tokens", "block_size", "usable"),
    [
        (0, 16, 0),
        (16, 16, 0),  # the last token is always computed, so one block exactly is never a hit
        (17, 16, 1),
        (32, 16, 1),
        (33, 16, 2),
        (400, 16, 24),
        (400, 1, 399),
    ],
)
def test_a_hit_never_covers_the_last_token(prompt_tokens: int, block_size: int, usable: int) -> None:
    assert usable_blocks(prompt_tokens, block_size) == usable


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    blocks = prompt_blocks(_ids(0, 40), None, 16)
    assert len(blocks) == 2
    same_start = prompt_blocks(_ids(0, 32), None, 16)
    assert same_start == blocks
    # The second block's content alone does not name it: its hash includes the first block.
    other_head = prompt_blocks(TokenPrompt((999, *range(1, 32))), None, 16)
    assert other_head[0] != blocks[0] and other_head[1] != blocks[1]


def test_a_shared_system_prompt_gives_shared_leading_blocks() -> None:
    system = "You are a contract reviewer. " * 20
    a = prompt_blocks(_chat(system, "first question"), None, 16)
    b = prompt_blocks(_chat(system, "something else entirely, longer"), None, 16)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared >= len(system) // 4 // 16 - 1
    assert a[:shared] == b[:shared]


def test_text_and_chat_of_the_same_words_are_different_prefixes() -> None:
    text = "x" * 256
    assert prompt_blocks(text, None, 16)[0] != prompt_blocks(_chat(text), None, 16)[0]


def test_block_hashes_of_an_empty_stream() -> None:
    assert block_hashes(b"", 16) == ()


def test_lookup_counts_leading_blocks_in_a_row_up_to_the_limit() -> None:
    cache = PrefixCache(capacity=100)
    blocks = prompt_blocks(_ids(0, 64), None, 16)  # 4 blocks
    assert cache.lookup(blocks, limit=4) == 0
    cache.remember(blocks[:3])
    assert cache.lookup(blocks, limit=4) == 3
    assert cache.lookup(blocks, limit=2) == 2
    # A prompt whose first block differs shares nothing, whatever follows.
    assert cache.lookup(prompt_blocks(TokenPrompt((7, *range(1, 64))), None, 16), limit=4) == 0


def test_lru_evicts_the_least_recent_prompt_and_its_tail_first() -> None:
    cache = PrefixCache(capacity=4)
    old = prompt_blocks(_ids(0, 32), None, 16)
    new = prompt_blocks(_ids(1000, 32), None, 16)
    cache.remember(old)
    cache.remember(new)
    assert len(cache) == 4
    assert cache.lookup(old, limit=2) == 2  # touching old makes new the least recent
    cache.remember(prompt_blocks(_ids(5000, 16), None, 16))
    assert len(cache) == 4
    assert cache.lookup(old, limit=2) == 2
    assert cache.lookup(new, limit=2) == 1  # new lost its tail block, its head still hits


def test_a_prompt_longer_than_the_cache_keeps_its_head() -> None:
    cache = PrefixCache(capacity=3)
    blocks = prompt_blocks(_ids(0, 16 * 5), None, 16)
    cache.remember(blocks)
    assert len(cache) == 3
    assert cache.lookup(blocks, limit=5) == 3


def test_with_a_tokenizer_the_stream_is_the_token_ids(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = FileTokenizer(str(tmp_path / "tokenizer.json"))
    text = "hello world " * 20  # 40 tokens, far fewer than its bytes / 4
    assert len(token_stream(text, loaded)) == 4 * count_prompt_tokens(text, loaded) == 160
    # The same words as token ids are the same prefix, as vLLM hashes token ids.
    assert prompt_blocks(text, loaded, 16) == prompt_blocks(TokenPrompt((1, 2) * 20), None, 16)
    chat = _chat("hello world hello")
    assert len(token_stream(chat, loaded)) == 4 * count_prompt_tokens(chat, loaded)


# Hashes the function gave before ``cache_salt`` existed: unsalted prompts must keep them, so a
# pod's cache and every recorded expectation stay valid.
_UNSALTED_GOLDEN: list[tuple[Prompt, tuple[str, ...]]] = [
    (_ids(0, 32), ("1b0cd756b8a49da656091d1fcc620279", "23c42dc62d8010a50554cd07c5d1c92d")),
    ("x" * 130, ("4df2d6bee2af56f6f849f72cb42670f3", "30f03c6012d5208dbbee99cb483aebff")),
]


@pytest.mark.parametrize(("prompt", "golden"), _UNSALTED_GOLDEN)
def test_no_salt_hashes_as_before_cache_salt_existed(prompt: Prompt, golden: tuple[str, ...]) -> None:
    assert tuple(h.hex() for h in prompt_blocks(prompt, None, 16)) == golden
    assert tuple(h.hex() for h in prompt_blocks(prompt, None, 16, salt=None)) == golden
    assert block_hashes(token_stream(prompt), 16, salt=None) == block_hashes(token_stream(prompt), 16)


def test_the_same_salt_gives_the_same_blocks() -> None:
    prompt = _ids(0, 64)
    salted = prompt_blocks(prompt, None, 16, salt="tenant-a")
    assert len(salted) == 4
    assert prompt_blocks(prompt, None, 16, salt="tenant-a") == salted


@pytest.mark.parametrize(
    ("salt", "other"),
    [
        ("a", "b"),
        ("a", None),
        (None, "a"),
        ("a", "a "),  # vLLM compares salts exactly: no trimming
        ("ab", "a"),
    ],
)
def test_different_salts_share_no_block(salt: str | None, other: str | None) -> None:
    """The salt is in the first block's hash and the chain carries it: not one block is shared,
    however long the common prompt."""
    prompt = _ids(0, 16 * 6)
    mine = prompt_blocks(prompt, None, 16, salt=salt)
    theirs = prompt_blocks(prompt, None, 16, salt=other)
    assert len(mine) == len(theirs) == 6
    assert set(mine).isdisjoint(theirs)


def test_a_salted_first_block_is_no_unsalted_later_block() -> None:
    """Salting replaces the first block's empty parent by a digest; that must not let a salted
    prompt's chain land on an unsalted one whose later block has the same tokens."""
    unsalted = prompt_blocks(TokenPrompt((*range(16), *range(100, 116))), None, 16)
    salted = prompt_blocks(_ids(100, 16), None, 16, salt="s")
    assert salted[0] not in unsalted


def test_a_salted_prompt_still_shares_its_head_with_the_same_salt() -> None:
    system = "You are a contract reviewer. " * 20
    a = prompt_blocks(_chat(system, "first question"), None, 16, salt="legal")
    b = prompt_blocks(_chat(system, "something else entirely, longer"), None, 16, salt="legal")
    shared = len(system) // 4 // 16 - 1  # whole blocks of the system prompt alone
    assert a[:shared] == b[:shared]


@pytest.mark.parametrize("salt", [None, "a"])
def test_a_prompt_shorter_than_a_block_has_no_blocks_salted_or_not(salt: str | None) -> None:
    assert prompt_blocks(_ids(0, 15), None, 16, salt=salt) == ()
    assert prompt_blocks("", None, 16, salt=salt) == ()


def test_salted_blocks_miss_a_cache_holding_the_same_prompt_unsalted() -> None:
    cache = PrefixCache(capacity=100)
    prompt = _ids(0, 64)
    cache.remember(prompt_blocks(prompt, None, 16))
    assert cache.lookup(prompt_blocks(prompt, None, 16, salt="a"), limit=4) == 0
    cache.remember(prompt_blocks(prompt, None, 16, salt="a"))
    assert cache.lookup(prompt_blocks(prompt, None, 16, salt="a"), limit=4) == 4
    assert cache.lookup(prompt_blocks(prompt, None, 16, salt="b"), limit=4) == 0
