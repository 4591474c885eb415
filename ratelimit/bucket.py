"""Token bucket math: pure functions on immutable records, the clock passed in.

A bucket holds up to ``capacity`` tokens (the ``burst``) and refills continuously at ``rate``
tokens per second. A request is a list of :class:`Hit` s and is decided all or nothing:

* ``hits > 0`` on a normal bucket: admitted iff the bucket holds ``hits`` tokens; takes them.
* ``hits == 0`` (check only) on a normal bucket: admitted iff it holds at least one token,
  i.e. iff one more request of cost 1 would pass now. Nothing is taken.
* A ``debt`` bucket (LLM tokens, charged after the response): ``hits == 0`` admits while the
  level is above 0; ``hits > 0`` is a charge of usage that already happened: always applied
  (even when another bucket denies the request), may drive the level below zero, never
  denies and is never refunded.
* A ``shadow`` bucket that cannot admit reports so but does not deny the request; it is not
  charged then.
* A ``concurrent`` bucket counts requests in flight: its level is the free slots (``capacity``
  minus the leases held), it never refills by time (``rate`` 0), and an admitted request takes
  one slot under its lease until the lease is released or expires (the stores keep the leases;
  here the level is all the math needs).

Token reservations (docs: Rate limits): a token bucket is a normal bucket charged the request's
reservation at admission; :func:`settled_level` applies the difference once the real usage is
known (a refund up to ``capacity``, or an overage that may put the bucket into debt).

The request is admitted iff every non-shadow bucket admits. A denied request takes nothing
from any normal bucket. The Redis Lua script (``lua.py``) implements exactly this function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

CONCURRENT_RETRY_S = 1.0
"""What a full concurrency cap tells the client to wait (a slot frees when any request ends)."""
EPSILON = 1e-9
"""Slack for float error: 3 x (1/3 s of refill at 1/s) must admit a 1-token request."""

# The records made on every call (a hit, a result, a verdict per bucket) are NamedTuples, not
# frozen dataclasses: as immutable, but built in ~0.25 µs instead of ~0.7 (a frozen dataclass
# sets each field through object.__setattr__), and a settlement batch makes hundreds of them.
# The spec, made once per config, stays a dataclass.


@dataclass(frozen=True)
class BucketSpec:
    capacity: float
    rate: float
    """Tokens per second."""
    debt: bool = False
    shadow: bool = False
    concurrent: bool = False
    """Slots of requests in flight (``capacity`` slots, ``rate`` 0), held under leases."""


class BucketState(NamedTuple):
    level: float
    stamp: float
    """Clock reading (seconds) when ``level`` was true."""


class Hit(NamedTuple):
    key: str
    spec: BucketSpec
    hits: int
    lease: str | None = None
    """Admission under a lease: a token charge is remembered under it (to be settled), a
    concurrent slot is held by it (to be released)."""


class Settle(NamedTuple):
    """The end of an admitted request, for one bucket: ``used`` tokens against what its lease
    reserved (a token bucket), or ``used`` None: release the lease's slot (a concurrent one)."""

    key: str
    spec: BucketSpec
    lease: str
    used: int | None


class BucketResult(NamedTuple):
    admitted: bool
    """This bucket's own verdict (the request may still be denied by another bucket)."""
    level: float
    """The level after the decision: charged if the request was admitted, else unchanged."""


class Decision(NamedTuple):
    admitted: bool
    results: tuple[BucketResult, ...]
    """One per hit, in order."""
    writes: Mapping[str, BucketState]
    """New state of every bucket that changed."""


class Verdict(NamedTuple):
    remaining: int
    """Whole tokens left now, never negative."""
    reset_s: float
    """Seconds until the bucket is full again."""
    retry_after_s: float | None
    """Seconds until the same hit could be admitted; 0 if admitted; None if never."""


def refill(state: BucketState | None, spec: BucketSpec, now: float) -> float:
    """The level at ``now``; a bucket never seen (or expired) is full."""
    if state is None:
        return spec.capacity
    elapsed = max(0.0, now - state.stamp)
    return min(spec.capacity, state.level + elapsed * spec.rate)


def admits(level: float, spec: BucketSpec, hits: int) -> bool:
    """Whether a bucket at ``level`` admits ``hits`` (see the module docstring)."""
    if spec.debt:
        return hits > 0 or level > EPSILON
    return level + EPSILON >= max(hits, 1)


def decide(states: Mapping[str, BucketState | None], hits: Sequence[Hit], now: float) -> Decision:
    """Decide a whole request against the bucket ``states`` read at ``now``.

    A key may appear more than once; later hits see the earlier ones' tentative charges.
    """
    base: dict[str, float] = {}
    for hit in hits:
        if hit.key not in base:
            base[hit.key] = refill(states.get(hit.key), hit.spec, now)

    tentative = dict(base)
    verdicts: list[bool] = []
    admitted = True
    for hit in hits:
        level = tentative[hit.key]
        ok = admits(level, hit.spec, hit.hits)
        verdicts.append(ok)
        if ok:
            tentative[hit.key] = level - hit.hits
        elif not hit.spec.shadow:
            admitted = False

    if admitted:
        final = tentative
    else:
        final = dict(base)
        for hit in hits:
            if hit.spec.debt and hit.hits > 0:
                final[hit.key] -= hit.hits
    results = tuple(BucketResult(ok, final[hit.key]) for hit, ok in zip(hits, verdicts, strict=True))
    writes = {key: BucketState(level, now) for key, level in final.items() if level != base[key]}
    return Decision(admitted, results, writes)


def settled_level(level: float, spec: BucketSpec, reserved: float, used: float) -> float:
    """The level after settling a reservation: unused tokens go back (never above capacity),
    an overage is charged (only the overage may put the bucket below zero)."""
    if used <= reserved:
        return min(spec.capacity, level + (reserved - used))
    return level - (used - reserved)


def report(spec: BucketSpec, result: BucketResult, hits: int) -> Verdict:
    """Remaining, reset and retry-after for one bucket's result."""
    level = result.level
    remaining = max(0, math.floor(level + EPSILON))
    reset = (spec.capacity - level) / spec.rate if spec.rate > 0 else 0.0
    reset = max(0.0, reset)
    if result.admitted:
        return Verdict(remaining, reset, 0.0)
    if spec.concurrent:
        return Verdict(remaining, 0.0, CONCURRENT_RETRY_S)
    if spec.debt:
        need = EPSILON * 2
    else:
        need = float(max(hits, 1))
        if need > spec.capacity + EPSILON:
            return Verdict(remaining, reset, None)
    if spec.rate <= 0:
        return Verdict(remaining, reset, None)
    return Verdict(remaining, reset, max(0.0, (need - level) / spec.rate))


def idle_ttl_s(spec: BucketSpec, level: float, margin_s: float = 1.0) -> float:
    """How long a bucket's state must be kept: until it is full again, plus a margin.

    After that the state is indistinguishable from a missing (full) bucket.
    """
    if spec.rate <= 0:
        return margin_s
    return max(0.0, (spec.capacity - level) / spec.rate) + margin_s
