"""Automatic prefix caching as vLLM does it: fixed token blocks named by chained hashes.

A prompt is cut into blocks of ``block_size`` tokens; block *k*'s hash covers its tokens and block
*k-1*'s hash, so a hash names the whole prefix up to that block. A pod remembers the hashes of the
blocks it computed, least recently used first out, bounded by its KV cache in blocks. A new
request's leading blocks found there skip prefill. As in vLLM's V1 engine, only full blocks are
cached and the prompt's last token is always computed (it yields the first output token's
logits), so a hit covers at most ``prompt_tokens - 1`` tokens, rounded down to whole blocks.

A request's ``cache_salt`` (vLLM V1) goes into its first block's hash only, as vLLM puts it in
the first block's extra keys; the chain carries it to every later block, so a salted prompt shares
no block with the same prompt unsalted or under another salt, and tenants that salt differently
cannot probe each other's prompts through prefill time. The same prompt and salt hit as before.

Tokens: with a ``tokenizer.json`` the token ids; without one, the same estimate that counts
tokens (``simulator.tokens``): every 4 UTF-8 bytes of a text are one token, a chat message's
template is 4 tokens named by its role and the reply opener 3 more. Each token is 4 bytes of the
stream hashed here, so the stream is exactly ``4 * count_prompt_tokens(prompt)`` bytes long.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from simulator.tokens import (
    CHAT_TOKENS_FOR_REPLY,
    CHAT_TOKENS_PER_MESSAGE,
    ChatPrompt,
    Prompt,
    TextTokenizer,
    TokenPrompt,
)

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default ``--block-size`` on CUDA."""

_UNIT = 4  # bytes per token in the hashed stream
_REPLY_OPENER = b"\xffreply\xff".ljust(_UNIT * CHAT_TOKENS_FOR_REPLY, b"\xff")
_SALT_DOMAIN = b"sim-cache-salt"  # blake2b personalisation (at most 16 bytes) of salt digests


def _pack_ids(ids: Sequence[int]) -> bytes:
    # Ids above 32 bits do not exist in real vocabularies; masking keeps one width per token.
    return array("I", (i & 0xFFFFFFFF for i in ids)).tobytes()


def _text_units(text: str, tokenizer: TextTokenizer | None) -> bytes:
    if tokenizer is not None:
        return _pack_ids(tokenizer.ids(text))
    raw = text.encode("utf-8")
    return raw + b"\0" * (-len(raw) % _UNIT)


def token_stream(prompt: Prompt, tokenizer: TextTokenizer | None = None) -> bytes:
    """The prompt's tokens, 4 bytes each, in the order the model reads them."""
    if isinstance(prompt, TokenPrompt):
        return _pack_ids(prompt.ids)
    if isinstance(prompt, str):
        return _text_units(prompt, tokenizer)
    return _chat_stream(prompt, tokenizer)


def _chat_stream(prompt: ChatPrompt, tokenizer: TextTokenizer | None) -> bytes:
    parts = []
    for message in prompt.messages:
        role = hashlib.blake2b(message.role.encode("utf-8"), digest_size=_UNIT * CHAT_TOKENS_PER_MESSAGE)
        parts.append(role.digest())
        parts.extend(_text_units(text, tokenizer) for text in message.texts)
    parts.append(_REPLY_OPENER)
    return b"".join(parts)


def block_hashes(stream: bytes, block_size: int, *, salt: str | None = None) -> tuple[bytes, ...]:
    """Chained hashes of every full block of ``stream`` (a ``token_stream``).

    With a ``salt`` the first block hashes the salt's digest where later blocks hash their
    parent's: 16 bytes of a separate domain, so no salted chain can meet an unsalted one or one
    of another salt short of a blake2b collision. Without one the hashes are unchanged.
    """
    width = block_size * _UNIT
    hashes = []
    parent = b"" if salt is None else _salt_key(salt)
    for start in range(0, len(stream) - width + 1, width):
        parent = hashlib.blake2b(parent + stream[start : start + width], digest_size=16).digest()
        hashes.append(parent)
    return tuple(hashes)


def _salt_key(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=_SALT_DOMAIN).digest()


def prompt_blocks(
    prompt: Prompt, tokenizer: TextTokenizer | None, block_size: int, *, salt: str | None = None
) -> tuple[bytes, ...]:
    """The block hashes of ``prompt`` under ``salt`` (a request's ``cache_salt``): what a pod
    caches after computing it."""
    return block_hashes(token_stream(prompt, tokenizer), block_size, salt=salt)


def usable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks a hit may cover: never the prompt's last token."""
    return max(0, prompt_tokens - 1) // block_size


class PrefixCache:
    """Block hashes a pod holds, least recently used evicted first beyond ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, blocks: Sequence[bytes], limit: int) -> int:
        """How many of the first ``limit`` ``blocks`` are cached, in a row from the start.

        The blocks found become the most recently used, as a hit pins them in vLLM.
        """
        found = 0
        for block in blocks[:limit]:
            if block not in self._blocks:
                break
            found += 1
        self._touch(blocks[:found])
        return found

    def remember(self, blocks: Sequence[bytes]) -> None:
        """``blocks`` were computed: keep them, evicting the least recently used over capacity."""
        self._touch(blocks)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def _touch(self, blocks: Sequence[bytes]) -> None:
        # Tail first, so a prompt's head is the most recent: vLLM frees a request's blocks in
        # reverse for the same reason, eviction eats prefixes from the end, where they are
        # least shared, and a head block is never evicted while its tail remains usable.
        for block in reversed(blocks):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
