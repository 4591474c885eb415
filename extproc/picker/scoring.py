"""The scorers: each maps one candidate pod to 0 (worst) .. 1 (best); a pod's total is
``sum(weight x score)`` with the weights of ``clusters.X.endpoint_picker.weights``.

| scorer      | score                                           | unknown pod (no fresh metrics) |
|-------------|-------------------------------------------------|--------------------------------|
| `queue`     | ``1 - (waiting + sent_since_scrape) / depth``   | ``0.5 - sent_since_scrape / depth`` |
| `kv_cache`  | ``1 - kv_usage``                                | 0.5                            |
| `in_flight` | ``1 - in_flight / depth``                       | the same (replica-local)       |
| `prefix`    | ``prefix_match x headroom``                     | the same, headroom = `queue`   |
| `thermal`   | 0 throttled, 1 not, 0.5 when DCGM does not say  | 0.5                            |

All clipped to 0..1. ``depth`` is the saturation queue depth (``saturation.queue_depth``, 32 by
default, also when shedding is off): absolute, not relative to the pool, so a score means the
same whatever the other pods do. A pool-relative ``1 - q/max_q`` would make 1 waiting request
against 0 the whole difference between best and worst, and ``1/(1+q)`` would halve a pod's
score for its first queued request; linear to ``depth`` charges each request the same,
``1/depth``, until the pod is as deep as the operator calls saturated.

``sent_since_scrape`` counts in `queue` (requests this replica sent that the last scrape could not
see) and ``in_flight`` in its own scorer, for known and unknown pods alike: a burst between two
scrapes, or while metrics are missing, spreads instead of herding onto the pod that looked best.

``headroom`` is the `queue` score, or 0 when the pod is saturated (waiting >= depth, or KV use >=
``saturation.kv_cache``): a cached prefix saves prefill, but not the wait behind a deep queue, and
is worth nothing on a saturated pod. With the default weights (queue 1, kv 1, in_flight 0.5,
prefix 2) a full prefix match outweighs a few queued requests and loses to an idle pod once the
prefix pod is about two thirds of the way to ``depth``, or saturated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from extproc.picker.state import Candidate, PodMetrics
from routing.picker_schema import PickerWeights, SaturationSpec

NEUTRAL = 0.5
"""What a metric scorer gives a pod it knows nothing about: between a free and a full pod, so an
unknown pod is neither avoided (it may be the only free one) nor flooded."""

_DEFAULT_SATURATION = SaturationSpec()


@dataclass(frozen=True)
class PoolContext:
    """What the scorers need besides the candidate: the pool's notion of full."""

    depth: float
    """Queue depth at which the queue and in-flight scores reach 0."""
    kv_full: float
    """KV-cache use (0..1) at which a pod is saturated."""

    @classmethod
    def of(cls, saturation: SaturationSpec | None) -> PoolContext:
        spec = saturation or _DEFAULT_SATURATION
        return cls(float(spec.queue_depth), spec.kv_cache)


def _clip(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def saturated(metrics: PodMetrics, ctx: PoolContext) -> bool:
    """Over the shedding thresholds (from the pod's own metrics: what it reported)."""
    return metrics.waiting >= ctx.depth or metrics.kv_usage >= ctx.kv_full


def queue(c: Candidate, ctx: PoolContext) -> float:
    waiting = c.metrics.waiting if c.metrics is not None else NEUTRAL * ctx.depth
    return _clip(1.0 - (waiting + c.sent_since_scrape) / ctx.depth)


def kv_cache(c: Candidate, ctx: PoolContext) -> float:
    return NEUTRAL if c.metrics is None else _clip(1.0 - c.metrics.kv_usage)


def in_flight(c: Candidate, ctx: PoolContext) -> float:
    return _clip(1.0 - c.in_flight / ctx.depth)


def prefix(c: Candidate, ctx: PoolContext) -> float:
    if c.prefix_match <= 0.0 or (c.metrics is not None and saturated(c.metrics, ctx)):
        return 0.0
    return _clip(c.prefix_match) * queue(c, ctx)


def thermal(c: Candidate, ctx: PoolContext) -> float:
    if c.metrics is None or c.metrics.throttled is None:
        return NEUTRAL
    return 0.0 if c.metrics.throttled else 1.0


Row = tuple[PodMetrics | None, int, int, float]
"""A candidate's inputs without the object: ``(metrics, sent_since_scrape, in_flight,
prefix_match)``. The pick builds these straight from the pool state (a frozen dataclass per pod
costs more than scoring it)."""


def score_rows(rows: Iterable[Row], weights: PickerWeights,
               ctx: PoolContext) -> tuple[list[float], list[float]]:
    """The totals of the rows, and their totals without the prefix scorer (the pick needs those
    to tell whether the prefix decided): the scorers above fused into one loop, because this is
    the pick's hot path. Tests hold it equal to the sum of weight x scorer."""
    wq, wk, wi, wp, wt = weights.queue, weights.kv_cache, weights.in_flight, weights.prefix, weights.thermal
    depth, kv_full = ctx.depth, ctx.kv_full
    totals: list[float] = []
    bases: list[float] = []
    for metrics, sent, open_, match in rows:
        if metrics is None:
            q = NEUTRAL - sent / depth
            kv = th = NEUTRAL
            full = False
        else:
            q = 1.0 - (metrics.waiting + sent) / depth
            kv = 1.0 - metrics.kv_usage
            th = NEUTRAL if metrics.throttled is None else 0.0 if metrics.throttled else 1.0
            full = metrics.waiting >= depth or metrics.kv_usage >= kv_full
        q = 0.0 if q < 0.0 else 1.0 if q > 1.0 else q
        kv = 0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv
        f = 1.0 - open_ / depth
        f = 0.0 if f < 0.0 else 1.0 if f > 1.0 else f
        base = wq * q + wk * kv + wi * f + wt * th
        bases.append(base)
        if match > 0.0 and not full:
            totals.append(base + wp * ((1.0 if match > 1.0 else match) * q))
        else:
            totals.append(base)
    return totals, bases


def parts(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> tuple[float, float]:
    """``(total without prefix, weighted prefix score)`` of one candidate, scorer by scorer:
    the reference :func:`score_rows` is tested against."""
    base = (weights.queue * queue(c, ctx) + weights.kv_cache * kv_cache(c, ctx)
            + weights.in_flight * in_flight(c, ctx) + weights.thermal * thermal(c, ctx))
    return base, weights.prefix * prefix(c, ctx)


def total(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> float:
    base, pre = parts(c, weights, ctx)
    return base + pre
