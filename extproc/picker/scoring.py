"""The scorers: each maps one candidate pod to 0 (worst) .. 1 (best); a pod's total is
``sum(weight x score)`` with the weights of ``clusters.X.endpoint_picker.weights``.

| scorer      | score                                           | unknown pod (no fresh metrics) |
|-------------|-------------------------------------------------|--------------------------------|
| `queue`     | ``1 - (waiting + sent_since_scrape) / depth``   | ``0.5 - sent_since_scrape / depth`` |
| `kv_cache`  | ``1 - kv_usage`` (0.5: the engine has no KV gauge) | 0.5                         |
| `in_flight` | ``1 - in_flight / depth``                       | the same (replica-local)       |
| `speed`     | ``best_cost / cost`` (below); 0.5 unmeasured    | 0.5                            |
| `prefix`    | ``prefix_match x headroom``                     | the same, headroom = `queue`   |
| `thermal`   | 0 throttled, 1 not, 0.5 when DCGM does not say  | 0.5                            |

``cost = tpot x (1 + waiting + sent_since_scrape)``; ``best_cost`` is the pool's lowest.

All clipped to 0..1. A pod whose engine exposes no KV gauge (``kv_usage`` None: TGI, recent
llama.cpp) is scored on what it has: `kv_cache` neutral, and saturated by its queue alone.

``depth`` is the saturation queue depth (``saturation.queue_depth``, 32 by default, also when
shedding is off): absolute, not relative to the pool, so a score means the same whatever the other
pods do. A pool-relative ``1 - q/max_q`` would make 1 waiting request against 0 the whole
difference between best and worst, and ``1/(1+q)`` would halve a pod's score for its first queued
request; linear to ``depth`` charges each request the same, ``1/depth``, until the pod is as deep
as the operator calls saturated.

``sent_since_scrape`` counts in `queue` (requests this replica sent that the last scrape could not
see) and ``in_flight`` in its own scorer, for known and unknown pods alike: a burst between two
scrapes, or while metrics are missing, spreads instead of herding onto the pod that looked best.

`speed` is the one pool-relative scorer, on purpose: it is what least request gets implicitly
(requests pile up on a slow pod) and the absolute scores miss (1 to 3 requests are 0.03 to 0.1
of `queue`). ``tpot`` is the pod's smoothed seconds per output token
(:attr:`~extproc.picker.state.PodState.tpot_s`, from vLLM's inter-token histogram), so ``cost``
is about how long a new request takes there: its tokens at the pod's pace, behind the requests
waiting there. Running requests are left out: on vLLM a bigger batch slows every token, so they
are in ``tpot`` already, and a batch with room takes one more without a wait. ``best_cost`` is
the lowest cost among the candidates whose cost is known: 1 for that pod, 0.5 for a pod twice
as slow, or as fast with a request waiting.

``headroom`` is the `queue` score times the pace (:func:`pace` of the `speed` score, 1 when the
pod's cost or the pool's best is unknown), or 0 when the pod is saturated (waiting >= depth, or
KV use >= ``saturation.kv_cache``): a cached prefix saves prefill, but not the wait behind a
deep queue, nor the pace of a slow pod, and is worth nothing on a saturated pod. The pace is 1
down to a `speed` score of 0.5 (pods of one pool differ by that much through load alone, no
reason to leave a conversation's cache), then falls with the square: a pod with four times the
pool's best cost (a 0.5x pod beside a 2x one, or one with 3 requests waiting beside an idle one
as fast) keeps a quarter of it. A `speed` weight of 0, the default, leaves the pace out too
(no ``best_cost``): the picker as it was before speed, because with `speed` 1 the
bench (bench/README.md) measured better tails and throughput but a slower median chat TTFT.

With the default weights (queue 1, kv 1, in_flight 0.5, speed 0, prefix 2) a full prefix match
outweighs a few queued requests and loses to an idle pod once the prefix pod is about two
thirds of the way to ``depth``, or saturated. With `speed` 1, a prefix on a pod at four times
the best cost is worth 0.5 (x the queue score) and loses to the best pod, 0.75 ahead on
`speed`.
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
    best_cost: float | None = None
    """The lowest :func:`cost` among the candidates; None: no candidate's is known (or `speed`
    weighs 0): `speed` is neutral for every pod and leaves the prefix headroom alone."""

    @classmethod
    def of(cls, saturation: SaturationSpec | None, rows: Iterable[Row] = ()) -> PoolContext:
        """The context of a pick among ``rows`` (none: no pool-relative `speed`)."""
        spec = saturation or _DEFAULT_SATURATION
        # :func:`cost` inlined: this runs on every pick, over every pod.
        best = min((tpot * (1.0 + metrics.waiting + sent) for metrics, sent, _, _, tpot in rows
                    if metrics is not None and tpot is not None and tpot > 0.0), default=None)
        return cls(float(spec.queue_depth), spec.kv_cache, best)


def cost(metrics: PodMetrics | None, sent: int, tpot_s: float | None) -> float | None:
    """Roughly how long a new request's tokens take on the pod, in the pod's seconds per token
    times the requests sharing or ahead of it; None when its metrics or speed are unknown."""
    if metrics is None or tpot_s is None or tpot_s <= 0.0:
        return None
    return tpot_s * (1.0 + metrics.waiting + sent)


def _clip(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def saturated(metrics: PodMetrics, ctx: PoolContext) -> bool:
    """Over the shedding thresholds (from the pod's own metrics: what it reported)."""
    kv = metrics.kv_usage
    return metrics.waiting >= ctx.depth or (kv is not None and kv >= ctx.kv_full)


def queue(c: Candidate, ctx: PoolContext) -> float:
    waiting = c.metrics.waiting if c.metrics is not None else NEUTRAL * ctx.depth
    return _clip(1.0 - (waiting + c.sent_since_scrape) / ctx.depth)


def kv_cache(c: Candidate, ctx: PoolContext) -> float:
    if c.metrics is None or c.metrics.kv_usage is None:
        return NEUTRAL
    return _clip(1.0 - c.metrics.kv_usage)


def in_flight(c: Candidate, ctx: PoolContext) -> float:
    return _clip(1.0 - c.in_flight / ctx.depth)


PACE_FREE = 0.5
"""A `speed` score from which a cached prefix keeps its whole value: pods of one pool differ by
this much through load alone, and that is no reason to leave a conversation's cache."""


def pace(sp: float) -> float:
    """The prefix headroom's speed factor: 1 down to :data:`PACE_FREE`, then falling with the
    square of the score (a pod four times the best cost: a quarter)."""
    return 1.0 if sp >= PACE_FREE else (sp / PACE_FREE) * (sp / PACE_FREE)


def speed(c: Candidate, ctx: PoolContext) -> float:
    mine = cost(c.metrics, c.sent_since_scrape, c.tpot_s)
    if mine is None or ctx.best_cost is None:
        return NEUTRAL
    return _clip(ctx.best_cost / mine)


def prefix(c: Candidate, ctx: PoolContext) -> float:
    if c.prefix_match <= 0.0 or (c.metrics is not None and saturated(c.metrics, ctx)):
        return 0.0
    known = ctx.best_cost is not None and cost(c.metrics, c.sent_since_scrape, c.tpot_s) is not None
    factor = pace(speed(c, ctx)) if known else 1.0
    return _clip(c.prefix_match) * queue(c, ctx) * factor


def thermal(c: Candidate, ctx: PoolContext) -> float:
    if c.metrics is None or c.metrics.throttled is None:
        return NEUTRAL
    return 0.0 if c.metrics.throttled else 1.0


Row = tuple[PodMetrics | None, int, int, float, float | None]
"""A candidate's inputs without the object: ``(metrics, sent_since_scrape, in_flight,
prefix_match, tpot_s)``. The pick builds these straight from the pool state (a frozen dataclass per pod
costs more than scoring it)."""


def score_rows(rows: Iterable[Row], weights: PickerWeights,
               ctx: PoolContext) -> tuple[list[float], list[float]]:
    """The totals of the rows, and their totals without the prefix scorer (the pick needs those
    to tell whether the prefix decided): the scorers above fused into one loop, because this is
    the pick's hot path. Tests hold it equal to the sum of weight x scorer."""
    wq, wk, wi, wp, wt = weights.queue, weights.kv_cache, weights.in_flight, weights.prefix, weights.thermal
    ws = weights.speed
    depth, kv_full, best = ctx.depth, ctx.kv_full, ctx.best_cost
    totals: list[float] = []
    bases: list[float] = []
    for metrics, sent, open_, match, tpot in rows:
        pf = 1.0  # the pace: the speed factor of the prefix headroom: 1 when the speed is unknown
        if metrics is None:
            q = NEUTRAL - sent / depth
            kv = th = sp = NEUTRAL
            full = False
        else:
            waiting, used = metrics.waiting, metrics.kv_usage
            q = 1.0 - (waiting + sent) / depth
            th = NEUTRAL if metrics.throttled is None else 0.0 if metrics.throttled else 1.0
            if used is None:  # the engine has no KV gauge
                kv, full = NEUTRAL, waiting >= depth
            else:
                kv, full = 1.0 - used, waiting >= depth or used >= kv_full
            if tpot is None or tpot <= 0.0 or best is None:
                sp = NEUTRAL
            else:
                sp = best / (tpot * (1.0 + waiting + sent))
                sp = 0.0 if sp < 0.0 else 1.0 if sp > 1.0 else sp
                if sp < PACE_FREE:
                    pf = sp / PACE_FREE
                    pf *= pf
        q = 0.0 if q < 0.0 else 1.0 if q > 1.0 else q
        kv = 0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv
        f = 1.0 - open_ / depth
        f = 0.0 if f < 0.0 else 1.0 if f > 1.0 else f
        base = wq * q + wk * kv + wi * f + wt * th + ws * sp
        bases.append(base)
        if match > 0.0 and not full:
            totals.append(base + wp * ((1.0 if match > 1.0 else match) * q * pf))
        else:
            totals.append(base)
    return totals, bases


def parts(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> tuple[float, float]:
    """``(total without prefix, weighted prefix score)`` of one candidate, scorer by scorer:
    the reference :func:`score_rows` is tested against."""
    base = (weights.queue * queue(c, ctx) + weights.kv_cache * kv_cache(c, ctx)
            + weights.in_flight * in_flight(c, ctx) + weights.thermal * thermal(c, ctx)
            + weights.speed * speed(c, ctx))
    return base, weights.prefix * prefix(c, ctx)


def total(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> float:
    base, pre = parts(c, weights, ctx)
    return base + pre
