"""Routing decisions (CONTRACT §5): context length, pool, canary variant and priority tier.

Pure functions on frozen values; no I/O, no protobuf.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from extproc.errors import ClientError, bad_request, context_length_exceeded
from routing.compiled import Canary, ModelRoute, Pool

CANARY_BUCKETS = 10_000


@dataclass(frozen=True)
class Decision:
    cluster: str
    upstream_model: str
    variant: str
    context_length: int
    prompt_tokens: int
    output_tokens: int
    priority: str


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
    """``weight = prompt_tokens * max_output_tokens / 1000`` bucketed into high|medium|low."""
    weight = prompt_tokens * output_tokens / 1000
    if weight < high_below:
        return "high"
    if weight >= low_from:
        return "low"
    return "medium"


def decide(model: ModelRoute, prompt_tokens: int, requested_output: int | None, hint: int,
           sticky_value: str, high_below: float, low_from: float) -> Decision:
    """Choose pool and variant for one request, or raise the 413 the client should get."""
    output = model.default_max_tokens if requested_output is None else requested_output
    length = context_length(prompt_tokens, output, hint)
    pool = pick_pool(model.pools, length)
    if pool is None:
        raise context_length_exceeded(model.name, model.max_context, length, prompt_tokens, output)
    cluster, upstream, variant = pool.cluster, model.name, "stable"
    canary = model.canary
    # A prompt the canary pool cannot hold stays on stable rather than failing there.
    if canary is not None and canary.max_context >= length \
            and on_canary(canary, sticky_value, model.name):
        cluster, upstream, variant = canary.cluster, canary.model, "canary"
    return Decision(
        cluster=cluster,
        upstream_model=upstream,
        variant=variant,
        context_length=length,
        prompt_tokens=prompt_tokens,
        output_tokens=output,
        priority=priority_tier(prompt_tokens, output, high_below, low_from),
    )


__all__ = ["ClientError", "Decision", "canary_bucket", "context_length", "decide",
           "on_canary", "parse_context_hint", "pick_pool", "priority_tier"]
