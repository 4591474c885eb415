"""What a simulated model generates, and when: pure decisions, no clocks, no sockets.

Output length (``plan_output``): a request that sets ``max_tokens`` gets exactly that many tokens
and finish reason ``length`` (the simulated model never stops early, so the budget is always what
cuts it); one that sets none gets ``default_output_tokens`` and ``stop``, unless the context
window leaves fewer, in which case it gets what is left and ``length``. With ``natural_stop``
every answer is ``default_output_tokens`` long (``stop``) unless the budget or the window cuts it
shorter (``length``), as a real model's end-of-sequence token ends its answer. A request's
``min_tokens`` lengthens the natural answer to at least that, as vLLM holds back the
end-of-sequence token until then.

Text: one word per token, chosen from a small vocabulary by a hash of the prompt, so the same
prompt always produces the same text in every process.

Timing (``timeline``): a sequence's prefill takes ``prefill * (prompt_tokens - cached)``, where
``cached`` is the part of its prompt found in the prefix cache; its k-th token (0-based) is
produced ``(k + 1) * decode`` after that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from simulator.errors import context_length_exceeded
from simulator.tokens import ChatPrompt, Prompt, TokenPrompt

FinishReason = Literal["stop", "length"]

_WORDS = (
    "the", "model", "token", "stream", "route", "pool", "cache", "batch",
    "queue", "prompt", "reply", "vector", "limit", "bucket", "canary", "cluster",
    "alpha", "beta", "gamma", "delta", "sigma", "omega", "river", "stone",
    "light", "north", "south", "quiet", "rapid", "green", "amber", "cobalt",
)  # fmt: skip


@dataclass(frozen=True)
class SequencePlan:
    """One sequence to run: its prompt size, the text of each output token, and why it ends.

    ``prefix_blocks`` are the prompt's block hashes for the prefix cache (``simulator.prefix``);
    ``None`` for a sequence the prefix cache does not see (embeddings).
    """

    prompt_tokens: int
    pieces: tuple[str, ...]
    finish_reason: FinishReason
    prefix_blocks: tuple[bytes, ...] | None = None

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens the sequence holds at most: its prompt and its whole output."""
        return self.prompt_tokens + len(self.pieces)

    @property
    def text(self) -> str:
        """The whole generated text."""
        return "".join(self.pieces)


@dataclass(frozen=True)
class TimelineStep:
    """At ``at`` seconds after admission, sequence ``seq`` produces token ``token``.

    ``token`` is -1 for a sequence that produces no tokens (an embedding): the step marks the end
    of its prefill.
    """

    at: float
    seq: int
    token: int


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise vLLM's context-length 400 when the prompt and requested output do not fit.

    A request without ``max_tokens`` still needs room for one output token.
    """
    wanted = 1 if max_tokens is None else max_tokens
    if prompt_tokens + wanted > max_model_len:
        raise context_length_exceeded(max_model_len, prompt_tokens, wanted)


def check_pooling_context(prompt_tokens: int, max_model_len: int) -> None:
    """Raise vLLM's context-length 400 for an embedding input longer than the window."""
    if prompt_tokens > max_model_len:
        raise context_length_exceeded(max_model_len, prompt_tokens, 0)


def plan_output(
    prompt: Prompt,
    prompt_tokens: int,
    max_tokens: int | None,
    default_output_tokens: int,
    max_model_len: int,
    prefix_blocks: tuple[bytes, ...] | None = None,
    natural_stop: bool = False,
    min_tokens: int = 0,
    choice: int = 0,
    drift: float = 0.0,
) -> SequencePlan:
    """The output of one prompt (see module docstring); checks the context window first.
    ``choice``: which of the prompt's ``n`` sequences (each samples other words); ``drift``:
    the share of its words replaced (:func:`drifted`)."""
    check_context(prompt_tokens, max_tokens, max_model_len)
    room = max_model_len - prompt_tokens
    natural = max(default_output_tokens, min_tokens)
    count: int
    finish: FinishReason
    if max_tokens is not None and not (natural_stop and natural < max_tokens):
        count, finish = max_tokens, "length"
    elif natural <= room:
        count, finish = natural, "stop"
    else:
        count, finish = room, "length"
    seed = prompt_seed(prompt) + (b"\0choice %d" % choice if choice else b"")
    pieces = output_pieces(seed, count)
    if drift > 0.0:
        pieces = drifted(pieces, seed, drift)
    return SequencePlan(prompt_tokens, pieces, finish, prefix_blocks)


def prompt_seed(prompt: Prompt) -> bytes:
    """Bytes that identify a prompt's content, for deriving its output deterministically."""
    if isinstance(prompt, str):
        return b"text\0" + prompt.encode("utf-8")
    if isinstance(prompt, TokenPrompt):
        return b"ids\0" + ",".join(map(str, prompt.ids)).encode("ascii")
    return b"chat\0" + _chat_bytes(prompt)


def _chat_bytes(prompt: ChatPrompt) -> bytes:
    parts = []
    for message in prompt.messages:
        parts.append(message.role.encode("utf-8"))
        parts.extend(text.encode("utf-8") for text in message.texts)
    return b"\0".join(parts)


def drifted(pieces: tuple[str, ...], seed: bytes, share: float) -> tuple[str, ...]:
    """``pieces`` with about ``share`` of its words replaced by others: word ``k`` is replaced
    when the ``k``-th byte of a second stream of ``seed`` falls below ``share`` of 256, by the
    word the third stream names (never itself). Deterministic, so a test can know the answer."""
    count = len(pieces)
    stream = hashlib.shake_256(b"drift\0" + seed).digest(2 * count)
    limit = share * 256.0
    out = list(pieces)
    for k in range(count):
        if stream[k] < limit:
            word = pieces[k].lstrip(" ")
            other = _WORDS[stream[count + k] % len(_WORDS)]
            if other == word:
                other = _WORDS[(stream[count + k] + 1) % len(_WORDS)]
            out[k] = ("" if k == 0 else " ") + other
    return tuple(out)


def output_pieces(seed: bytes, count: int) -> tuple[str, ...]:
    """``count`` words derived from ``seed``; every word after the first has a leading space."""
    stream = hashlib.shake_256(seed).digest(count)
    return tuple(("" if k == 0 else " ") + _WORDS[byte % len(_WORDS)] for k, byte in enumerate(stream))


def timeline(
    plans: tuple[SequencePlan, ...],
    prefill_s_per_token: float,
    decode_s_per_token: float,
    cached: tuple[int, ...] | None = None,
) -> list[TimelineStep]:
    """Every token of every sequence in the order they are produced (ties: sequence order).

    ``cached[i]`` is how many prompt tokens of sequence ``i`` the prefix cache supplied.
    """
    steps = []
    for seq, plan in enumerate(plans):
        computed = plan.prompt_tokens - (cached[seq] if cached is not None else 0)
        prefill = prefill_s_per_token * computed
        if not plan.pieces:
            steps.append(TimelineStep(prefill, seq, -1))
        for k in range(len(plan.pieces)):
            steps.append(TimelineStep(prefill + (k + 1) * decode_s_per_token, seq, k))
    steps.sort(key=lambda step: (step.at, step.seq, step.token))
    return steps
