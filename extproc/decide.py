"""Routing decisions (docs: Identity, canaries and priority): context length, pool, canary
variant, priority tier, and the token reservation the rate limiter charges at admission (docs: Rate limits).

Pure functions on frozen values; no I/O, no protobuf.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from extproc.errors import ClientError, bad_request, context_length_exceeded
from extproc.quick_init import quick_init
from routing.compiled import Canary, ModelRoute, Pool

CANARY_BUCKETS = 10_000


@quick_init
@dataclass(frozen=True)
class Demand:
    """What one request asks of a pool, counted."""

    prompt_tokens: tuple[int, ...]
    """Counted tokens of each prompt: one for chat (and embeddings' longest input), one per
    entry of a batched completion."""
    max_output_tokens: int | None
    """Output tokens per sequence the client asked for; None: the model's default."""
    choices: int = 1
    """Sequences generated per prompt (``n``, or ``best_of`` when larger)."""
    min_output_tokens: int = 0
    """vLLM's ``min_tokens``: with no ``max_output_tokens``, the output assumed is at least this."""


@quick_init
@dataclass(frozen=True)
class Decision:
    cluster: str
    upstream_model: str
    variant: str
    context_length: int
    prompt_tokens: int
    """Counted tokens of all prompts."""
    output_tokens: int
    """Output asked for by all sequences of all prompts."""
    priority: str
    sequences: int = 1
    """Sequences generated side by side: every choice (``n``) of every prompt."""

    @property
    def reservation(self) -> int:
        """Tokens charged at admission (docs: Rate limits): every prompt plus all requested output."""
        return self.prompt_tokens + self.output_tokens


def output_per_sequence(demand: Demand, default_max_tokens: int) -> int:
    """The client's budget, else the model's default (or ``min_tokens`` when larger: vLLM
    generates at least that)."""
    if demand.max_output_tokens is None:
        return max(default_max_tokens, demand.min_output_tokens)
    return demand.max_output_tokens


def requested_output(demand: Demand, default_max_tokens: int) -> int:
    """Output of every sequence of every prompt: per-sequence budget x choices x prompts."""
    return output_per_sequence(demand, default_max_tokens) * demand.choices \
        * len(demand.prompt_tokens)


def reservation(demand: Demand, default_max_tokens: int) -> int:
    """Counted prompt tokens (all prompts) + requested output (max_completion_tokens, else
    max_tokens, else the model's default) x choices, for every prompt of a batch."""
    return sum(demand.prompt_tokens) + requested_output(demand, default_max_tokens)


def parse_context_hint(value: str | None) -> int:
    """The client's ``X-Context-Length`` (0 when absent); a 400 when it is not a whole number."""
    if value is None or value == "":
        return 0
    text = value.strip()
    if not text.isdigit() or len(text) > 12:
        raise bad_request("X-Context-Length must be a non-negative whole number of tokens.",
                          param="X-Context-Length", code="invalid_context_length")
    return int(text)


def context_length(prompt_tokens: int, output_tokens: int, hint: int) -> int:
    """The client hint can raise the length, never lower it."""
    return max(hint, prompt_tokens + output_tokens)


def pick_pool(pools: tuple[Pool, ...], length: int) -> Pool | None:
    """The pool with the smallest ``max_context`` that fits ``length`` (pools sorted ascending)."""
    for pool in pools:
        if pool.max_context >= length:
            return pool
    return None


def canary_bucket(sticky_value: str, model: str) -> int:
    """A stable bucket in [0, 10000) for (sticky value, model)."""
    digest = hashlib.blake2b(f"{sticky_value}\x00{model}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % CANARY_BUCKETS


def on_canary(canary: Canary | None, sticky_value: str, model: str) -> bool:
    """Whether this sticky value lands on the canary; raising ``percent`` keeps earlier ones."""
    if canary is None or canary.threshold <= 0:
        return False
    return canary_bucket(sticky_value, model) < canary.threshold


def priority_tier(prompt_tokens: int, output_tokens: int, high_below: float, low_from: float) -> str:
    """``weight = prompt_tokens * max_output_tokens / 1000`` bucketed into high|medium|low.

    For a request, ``prompt_tokens`` is its longest prompt and ``output_tokens`` the output of
    all its sequences (:func:`requested_output`): asking for many choices or prompts in one
    request weighs what asking for them one by one would, and never less.
    """
    weight = prompt_tokens * output_tokens / 1000
    if weight < high_below:
        return "high"
    if weight >= low_from:
        return "low"
    return "medium"


def decide(model: ModelRoute, demand: Demand, hint: int, sticky_value: str, high_below: float,
           low_from: float) -> Decision:
    """Choose pool and variant for one request, or raise the 413 the client should get.

    Each sequence of each prompt is its own context in vLLM: the longest prompt plus one
    sequence's output must fit the pool.
    """
    longest = max(demand.prompt_tokens, default=0)
    output = output_per_sequence(demand, model.default_max_tokens)
    length = context_length(longest, output, hint)
    pool = pick_pool(model.pools, length)
    if pool is None:
        raise context_length_exceeded(model.name, model.max_context, length, longest, output)
    cluster, upstream, variant = pool.cluster, model.name, "stable"
    canary = model.canary
    # A prompt the canary pool cannot hold stays on stable rather than failing there.
    if canary is not None and canary.max_context >= length \
            and on_canary(canary, sticky_value, model.name):
        cluster, upstream, variant = canary.cluster, canary.model, "canary"
    total_output = requested_output(demand, model.default_max_tokens)
    return Decision(
        cluster=cluster,
        upstream_model=upstream,
        variant=variant,
        context_length=length,
        prompt_tokens=sum(demand.prompt_tokens),
        output_tokens=total_output,
        priority=priority_tier(longest, total_output, high_below, low_from),
        sequences=max(1, len(demand.prompt_tokens)) * demand.choices,
    )


__all__ = ["ClientError", "Decision", "Demand", "canary_bucket", "context_length", "decide",
           "on_canary", "output_per_sequence", "parse_context_hint", "pick_pool", "priority_tier",
           "requested_output", "reservation"]
