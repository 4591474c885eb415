"""The scorers: each maps one candidate pod to 0 (worst) .. 1 (best); a pod's total is
``sum(weight x score)`` with the weights of ``clusters.X.endpoint_picker.weights``.

| scorer      | score                                           | unknown pod (no fresh metrics) |
|-------------|-------------------------------------------------|--------------------------------|
| `latency`   | ``best_eta / eta`` (:func:`eta`): the default   | an average pod with room, x2   |
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
bench (bench/JOURNAL.md, "Speed-aware picking (issue 15)")
measured better tails and throughput but a slower median chat TTFT.

The default weights are `latency` 1 and `thermal` 1, the rest 0 (issue 36). Before, the
defaults were queue 1, kv 1, in_flight 0.5, speed 0, prefix 2: near capacity on pods of uneven
speed, prefix affinity outweighed queues that the linear `queue` score, scaled to a depth of 32,
barely saw at 6 sequences a pod, and the slowest pod got more work than under Envoy's least
request (TTFT P99 6.4x worse); `speed` 1 starved a pod that had room. `latency` estimates, in
seconds, when the request would be served on each pod (:func:`eta`): the wait for a sequence
slot against the pod's own capacity, the prefill its prefix cache would not save, and the
request's own tokens at the pod's pace. A cached prefix is then worth the prefill it saves and
never more than a queue; a slow pod gets the requests it can serve soonest (short ones), and
the share floor of :mod:`extproc.picker.pick` keeps it from sitting idle while the pool is busy.
The other scorers remain, to weigh by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from extproc.picker.state import Candidate, PodMetrics
from routing.picker_schema import PickerWeights, SaturationSpec

NEUTRAL = 0.5
"""What a metric scorer gives a pod it knows nothing about: between a free and a full pod, so an
unknown pod is neither avoided (it may be the only free one) nor flooded."""

_DEFAULT_SATURATION = SaturationSpec()


PREFILL_SHARE = 0.01
"""Seconds of prefill per uncached prompt token, as a share of the pod's seconds per output
token. Engines report neither prefill speed nor its ratio to decode; on GPUs prefill runs one
to two orders of magnitude more tokens a second than one sequence's decode (vLLM's chunked
prefill takes 2,048 to 8,192 prompt tokens a step, a decode step one token per sequence), and a
slower GPU is slower at both. One hundredth makes a 1,000-token prompt cost what 10 output
tokens do: a cached prefix is worth that, and never more than the requests queued before it."""

DECODE_SHARE = 0.1
"""How much the request's own decode time counts in :func:`eta` against its wait and prefill.
1 would rank pods by when the request finishes (shortest expected delay): the fast pods' queues
then grow a few requests deep before an idle slow pod gets one, and the time to first token
pays. 0 would rank by the first token alone and send a long answer to a pod three times as slow
as readily as to a fast one. On the issue-36 bench (``python -m bench.picker_capacity``: pods at
1x, 1x, 1.5x and 3x, 60% to 100% of capacity), 0.5 left the median TTFT at 1.2x least request's
at full load, 0.2 at 1.0x, and 0.1 at 0.7x with the end-to-end P99 still 0.66-0.76x."""


DEFAULT_BACKLOG_TOKENS = 256.0
"""What a queued request is taken to generate before the picker has seen an output budget."""


@dataclass(frozen=True)
class Work:
    """What a request asks of a pod: prompt tokens to prefill, output tokens to generate."""

    prompt_tokens: int = 0
    output_tokens: int = 0


NO_WORK = Work()


@dataclass(frozen=True)
class PoolContext:
    """What the scorers need besides the candidate: the pool's notion of full, and for
    `latency` the request's work and the pool's pace."""

    depth: float
    """Queue depth at which the queue and in-flight scores reach 0."""
    kv_full: float
    """KV-cache use (0..1) at which a pod is saturated."""
    best_cost: float | None = None
    """The lowest :func:`cost` among the candidates; None: no candidate's is known (or `speed`
    weighs 0): `speed` is neutral for every pod and leaves the prefix headroom alone."""
    work: Work = NO_WORK
    """The request's prompt and output tokens."""
    backlog_tokens: float = DEFAULT_BACKLOG_TOKENS
    """Output tokens of a typical request of the pool (what each one queued ahead will
    generate): the mean of the output budgets the picker saw (:data:`DEFAULT_BACKLOG_TOKENS`
    before it saw one)."""
    pace: float = 1.0
    """Seconds per output token of a pod whose own is not known yet: the known pods' median
    (1 when none is known: the estimates are then in tokens, still comparable)."""
    best_eta: float | None = None
    """The lowest :func:`eta` among the candidates; None: `latency` weighs 0 (or no
    candidates): it scores every pod neutrally."""
    etas: tuple[float, ...] = field(default=(), compare=False, repr=False)
    """:func:`eta` of each candidate, in order (when ``best_eta`` is not None)."""

    @classmethod
    def of(cls, saturation: SaturationSpec | None, rows: Sequence[Row] = (), *,
           speed: bool = True, latency: bool = False, work: Work = NO_WORK,
           backlog_tokens: float = 0.0, pace: float | None = None) -> PoolContext:
        """The context of a pick among ``rows`` (none: no pool-relative `speed` nor
        `latency`); ``speed``, ``latency``: whether those scorers count; ``pace``: the pool's
        median pace, when the caller knows it (else the median of the rows' paces)."""
        spec = saturation or _DEFAULT_SATURATION
        best = None
        if speed:
            # :func:`cost` inlined: this runs on every pick, over every pod.
            best = min((row[4] * (1.0 + row[0].waiting + row[1]) for row in rows
                        if row[0] is not None and row[4] is not None and row[4] > 0.0),
                       default=None)
        backlog_tokens = backlog_tokens or DEFAULT_BACKLOG_TOKENS
        ctx = cls(float(spec.queue_depth), spec.kv_cache, best, work, backlog_tokens)
        if not latency or not rows:
            return ctx
        if pace is None:
            known = sorted([row[4] for row in rows if row[4] is not None and row[4] > 0.0])
            pace = known[len(known) // 2] if known else 1.0
        # :func:`eta` inlined, once per row: the fused loop reads them back.
        prompt_cost = work.prompt_tokens * PREFILL_SHARE
        fixed = 1.0 + DECODE_SHARE * work.output_tokens
        unknown = UNKNOWN_FACTOR * pace * (prompt_cost + fixed)
        depth, kv_full = ctx.depth, ctx.kv_full
        etas: list[float] = []
        for metrics, sent, _, match, tpot, capacity, load in rows:
            if metrics is None:
                etas.append(unknown * (1.0 + sent / depth))
                continue
            running, waiting, used = metrics.running, metrics.waiting, metrics.kv_usage
            if load is None:
                load = running + waiting + sent
            if used is not None and used >= kv_full:
                capacity = running if running > 1.0 else 1.0
                load = load if load > capacity else capacity
            elif capacity is None and waiting > 0.0:
                capacity = running if running > 1.0 else 1.0
            wait = 0.0
            if capacity is not None and load >= capacity:
                wait = (load - capacity + 1.0) / (capacity if capacity > 1.0 else 1.0) * backlog_tokens
            uncached = 1.0 if match <= 0.0 else 0.0 if match >= 1.0 else 1.0 - match
            etas.append((tpot if tpot is not None and tpot > 0.0 else pace)
                        * (wait + uncached * prompt_cost + fixed))
        return cls(depth, kv_full, best, work, backlog_tokens, pace, min(etas), tuple(etas))


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


TIE_TOKENS = 2.0
"""Estimates within this many tokens' time (at the pool's median pace) of the best count as the
best: for a short request on idle pods, a 256-byte block of shared preamble in one pod's prefix
cache, or a pace measured a little lower, is a large share of a small estimate but a few
milliseconds, and must not send every such request to the one pod (the pick's tie band then
spreads them)."""

UNKNOWN_FACTOR = 2.0
"""A pod without fresh metrics is estimated as a pod with room at the pool's pace, this many
times over (and more for what this replica sent it since): it wins against pods with a wait
longer than a whole request, and a burst onto it spreads."""


def eta(metrics: PodMetrics | None, sent: int, match: float, tpot_s: float | None,
        capacity: float | None, ctx: PoolContext, load: float | None = None) -> float:
    """Roughly when the request's answer would be worth having from this pod, in seconds: the
    wait for a free sequence slot, the prefill of what the prefix cache does not hold, the first
    token, and :data:`DECODE_SHARE` of the rest (:data:`UNKNOWN_FACTOR` for a pod whose metrics
    are not fresh).

    The pod's ``load`` is what it runs and queues: by default what its metrics say plus what
    this replica sent since they were read (the pick gives a better count: what the other
    replicas had there at the scrape, and what this one has open now, which also sees a
    sequence that ended since). It has room while that is below its ``capacity`` (the sequences it was seen
    running while others waited: ``max_num_seqs`` or its KV cache, whichever binds; None: never
    seen full) and its KV cache is below ``saturation.kv_cache``. Past that, each request in
    line ahead waits for a slot, and slots free at ``capacity`` per typical request's time
    (``backlog_tokens`` at the pod's pace)."""
    work = ctx.work
    if metrics is None:  # an average pod with room, twice over: neither avoided nor flooded
        return (UNKNOWN_FACTOR * ctx.pace * (work.prompt_tokens * PREFILL_SHARE + 1.0
                                             + DECODE_SHARE * work.output_tokens)
                * (1.0 + sent / ctx.depth))
    tau = tpot_s if tpot_s is not None and tpot_s > 0.0 else ctx.pace
    if load is None:
        load = metrics.running + metrics.waiting + sent
    kv = metrics.kv_usage
    if kv is not None and kv >= ctx.kv_full:  # no room until a sequence ends
        capacity = max(1.0, metrics.running)
        load = max(load, capacity)
    elif capacity is None and metrics.waiting > 0:  # full now, never seen so before
        capacity = max(1.0, metrics.running)
    wait = 0.0
    if capacity is not None and load >= capacity:
        wait = (load - capacity + 1.0) / max(capacity, 1.0) * ctx.backlog_tokens * tau
    uncached = 1.0 - (1.0 if match > 1.0 else match)
    return wait + tau * (uncached * work.prompt_tokens * PREFILL_SHARE + 1.0
                         + DECODE_SHARE * work.output_tokens)


def latency(c: Candidate, ctx: PoolContext) -> float:
    if ctx.best_eta is None:
        return NEUTRAL
    mine = eta(c.metrics, c.sent_since_scrape, c.prefix_match if c.metrics else 0.0, c.tpot_s,
               c.capacity, ctx, c.load)
    if mine <= ctx.best_eta + TIE_TOKENS * ctx.pace:
        return 1.0
    return _clip(ctx.best_eta / mine)


def thermal(c: Candidate, ctx: PoolContext) -> float:
    if c.metrics is None or c.metrics.throttled is None:
        return NEUTRAL
    return 0.0 if c.metrics.throttled else 1.0


Row = tuple[PodMetrics | None, int, int, float, float | None, float | None, float | None]
"""A candidate's inputs without the object: ``(metrics, sent_since_scrape, in_flight,
prefix_match, tpot_s, capacity, load)``. The pick builds these straight from the pool state (a frozen
dataclass per pod costs more than scoring it)."""


def score_rows(rows: Iterable[Row], weights: PickerWeights,
               ctx: PoolContext) -> tuple[list[float], list[float]]:
    """The totals of the rows, and their totals without what the prefix cache adds (the pick
    needs those to tell whether the prefix decided): the scorers above fused into one loop,
    because this is the pick's hot path. Tests hold it equal to the sum of weight x scorer."""
    wq, wk, wi, wp, wt = weights.queue, weights.kv_cache, weights.in_flight, weights.prefix, weights.thermal
    ws, wl = weights.speed, weights.latency
    depth, kv_full, best = ctx.depth, ctx.kv_full, ctx.best_cost
    best_eta, pace, etas = ctx.best_eta, ctx.pace, ctx.etas
    prompt_cost = ctx.work.prompt_tokens * PREFILL_SHARE
    near = best_eta + TIE_TOKENS * pace if best_eta is not None else 0.0
    totals: list[float] = []
    bases: list[float] = []
    if best_eta is not None and wq == wk == wi == wp == ws == 0.0:
        # The default weights (`latency` and `thermal`): the other scorers are not computed.
        for i, (metrics, _, _, match, tpot, _, _) in enumerate(rows):
            mine = etas[i]
            lat = 1.0 if mine <= near else best_eta / mine
            lat_base = lat
            th = NEUTRAL
            if metrics is not None:
                if metrics.throttled is not None:
                    th = 0.0 if metrics.throttled else 1.0
                if match > 0.0:
                    tau = tpot if tpot is not None and tpot > 0.0 else pace
                    mine += tau * prompt_cost * (1.0 if match > 1.0 else match)
                    lat_base = 1.0 if mine <= near else best_eta / mine
            base = wt * th + wl * lat_base
            bases.append(base)
            totals.append(base + wl * (lat - lat_base))
        return totals, bases
    for i, (metrics, sent, open_, match, tpot, _, _) in enumerate(rows):
        pf = 1.0  # the pace: the speed factor of the prefix headroom: 1 when the speed is unknown
        lat = lat_base = NEUTRAL
        if metrics is None:
            q = NEUTRAL - sent / depth
            kv = th = sp = NEUTRAL
            full = False
            if best_eta is not None:
                mine = etas[i]
                lat = lat_base = 1.0 if mine <= near else best_eta / mine
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
            if best_eta is not None:
                mine = etas[i]
                lat = 1.0 if mine <= near else best_eta / mine
                if match > 0.0:  # what the pod's prefix cache saves: the score without it
                    tau = tpot if tpot is not None and tpot > 0.0 else pace
                    mine += tau * prompt_cost * (1.0 if match > 1.0 else match)
                    lat_base = 1.0 if mine <= near else best_eta / mine
                else:
                    lat_base = lat
        q = 0.0 if q < 0.0 else 1.0 if q > 1.0 else q
        kv = 0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv
        f = 1.0 - open_ / depth
        f = 0.0 if f < 0.0 else 1.0 if f > 1.0 else f
        base = wq * q + wk * kv + wi * f + wt * th + ws * sp + wl * lat_base
        bases.append(base)
        if match > 0.0 and not full:
            totals.append(base + wp * ((1.0 if match > 1.0 else match) * q * pf)
                          + wl * (lat - lat_base))
        else:
            totals.append(base + wl * (lat - lat_base))
    return totals, bases


def parts(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> tuple[float, float]:
    """``(total without the prefix cache, what the prefix cache adds)`` of one candidate,
    scorer by scorer: the reference :func:`score_rows` is tested against."""
    without = latency(replace(c, prefix_match=0.0), ctx)
    base = (weights.queue * queue(c, ctx) + weights.kv_cache * kv_cache(c, ctx)
            + weights.in_flight * in_flight(c, ctx) + weights.thermal * thermal(c, ctx)
            + weights.speed * speed(c, ctx) + weights.latency * without)
    return base, weights.prefix * prefix(c, ctx) + weights.latency * (latency(c, ctx) - without)


def total(c: Candidate, weights: PickerWeights, ctx: PoolContext) -> float:
    base, pre = parts(c, weights, ctx)
    return base + pre
