"""What one extproc replica knows about the pods of each endpoint-picker pool.

The scraper (:mod:`extproc.picker.scrape`) writes: the pool's current addresses (``set_addresses``,
after each DNS resolution) and each pod's metrics (``record_scrape`` / ``record_failure``). The
picker (:mod:`extproc.picker.pick`) reads ``candidates`` and writes ``sent`` / ``done``. All of it
runs on the event loop's thread, so no locks.

A pod whose metrics are missing, failing or older than ``stale_s`` is *unknown*: still a
candidate, scored neutrally. A pod the scraper could not even connect to on
:data:`UNREACHABLE_AFTER` scrapes in a row is *unreachable*: still a candidate, but the picker
names it first only when no pod is reachable, because Envoy tries a picked pod whatever its
health checks say (docs/concepts/picker.md), so a dead first pick costs a failed connect.

A pod that answers :data:`EJECT_AFTER` picked requests in a row with a 5xx is *ejected* for a
while (``record_answer``), and ranked as an unreachable one meanwhile: a pod whose engine
fails every request fails fast, so its queue looks empty and the scorers would otherwise send
it the most traffic. At most :data:`MAX_EJECTED_SHARE` of a pool's pods are out at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

TPOT_ALPHA = 0.2
"""Weight of the newest interval in a pod's smoothed time per output token: at a 100 ms scrape
interval about a second of memory, enough to ride out one interval of a few slow tokens (a long
prefill stalling the batch) and still follow a pod that slows down under load in seconds."""

MIN_TPOT_S = 1e-6
"""Floor of a measured time per output token: the speed scorer divides by it."""

EJECT_AFTER = 5
"""Picked requests in a row a pod answers with a 5xx before it is ejected (Envoy's outlier
detection defaults to the same five)."""

EJECT_BASE_S = 10.0
"""The first ejection's length; each next one in a row doubles it, up to :data:`EJECT_MAX_S`."""

EJECT_MAX_S = 300.0

MAX_EJECTED_SHARE = 0.5
"""Most of a pool's pods ejected at once (at least one): requests that make every pod fail
(a bad model, or a client that found a prompt vLLM answers 500) cannot empty the pool."""

CAPACITY_GUESS = 16.0
"""Sequences a pod never seen with requests waiting is taken to run at once (or what it was seen
running, if more). vLLM's own default is 256, but until a pod has been seen full nothing says
its KV cache holds that many; underestimating costs a request sent to a pod as good, while
overestimating sends a burst to one pod."""

SHARE_WINDOW = 200
"""The last picks of a pool each pod's share of them is counted over."""

UNREACHABLE_AFTER = 2
"""Connection failures in a row that make a pod unreachable: one can be a blip (a pod
restarting, a dropped SYN), two at the scrape interval and its backoff (~3 intervals) is a pod
that would cost a failed connect now."""


@dataclass(frozen=True)
class PodMetrics:
    """One scrape of a pod: its engine's gauges and counters (vLLM's names below; the other
    engines' in :mod:`extproc.picker.engines`), and DCGM's when a URL is configured."""

    waiting: float = 0.0
    """``vllm:num_requests_waiting``."""
    running: float = 0.0
    """``vllm:num_requests_running``."""
    kv_usage: float | None = 0.0
    """``vllm:kv_cache_usage_perc`` (or the older ``vllm:gpu_cache_usage_perc``), 0 to 1; None
    when the pod's engine exposes no KV gauge (TGI, recent llama.cpp)."""
    prefix_queries: float = 0.0
    """``vllm:prefix_cache_queries`` (tokens, cumulative)."""
    prefix_hits: float = 0.0
    """``vllm:prefix_cache_hits`` (tokens, cumulative)."""
    token_gap_sum: float = 0.0
    """``vllm:inter_token_latency_seconds_sum`` (or the older
    ``vllm:time_per_output_token_seconds_sum``): seconds between output tokens, cumulative."""
    token_gap_count: float = 0.0
    """The same histogram's ``_count``: output tokens after each sequence's first, cumulative."""
    gpu_temp_c: float | None = None
    """DCGM ``DCGM_FI_DEV_GPU_TEMP``; None when unknown."""
    gpu_mem_used_frac: float | None = None
    """DCGM framebuffer used / (used + free); None when unknown."""
    throttled: bool | None = None
    """DCGM ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` has a thermal or power bit set; None when
    unknown."""


@dataclass(frozen=True)
class Candidate:
    """One pod as the scorers see it at pick time (pure data)."""

    address: str
    """``ip:port``, as Envoy's override-host policy names a host."""
    metrics: PodMetrics | None
    """None: unknown (never scraped, failing, or stale)."""
    sent_since_scrape: int
    """Requests this replica sent the pod since its metrics were read (not in them yet)."""
    in_flight: int
    """Requests this replica has open on the pod."""
    prefix_match: float = 0.0
    """0 to 1: share of the prompt's leading blocks this pod served recently."""
    unreachable: bool = False
    """The scraper could not connect to it lately (:attr:`PodState.unreachable`)."""
    tpot_s: float | None = None
    """The pod's smoothed seconds per output token (:attr:`PodState.tpot_s`); None: unknown."""
    capacity: float | None = None
    """Sequences the pod runs at once (:attr:`PodState.capacity`); None: never seen full."""
    load: float | None = None
    """Sequences on the pod now, as best this replica knows: what the other replicas had running
    or waiting there at the scrape, plus what this one has open now (the pick counts it so, and
    so follows its own requests both ways between scrapes); None: its metrics plus what this
    replica sent since."""


@dataclass
class PodState:
    address: str
    metrics: PodMetrics | None = None
    scraped_at: float | None = None
    """Event-loop time of the last good scrape."""
    failures: int = 0
    """Scrapes failed in a row."""
    failures_total: int = 0
    """Scrapes failed since the pod joined the pool (the metrics' counter)."""
    connect_failures: int = 0
    """Scrapes in a row that could not connect (refused, connect timeout); 0 once a scrape
    connects, whatever it then gets (an HTTP error or a bad body is a pod that answers)."""
    sent_since_scrape: int = 0
    in_flight: int = 0
    prefix_hit_rate: float | None = None
    """Hits / queries between the last two good scrapes (None before two)."""
    tpot_s: float | None = None
    """Seconds per output token, an EWMA (:data:`TPOT_ALPHA`) of the mean between good scrapes
    that saw new tokens; None until one has. Kept while the pod idles (its speed is still
    its speed) and across failed scrapes."""
    capacity: float | None = None
    """Sequences the pod runs at once when it has more to run: ``running`` at a scrape that saw
    requests waiting (vLLM's ``max_num_seqs``, or fewer when its KV cache binds first). A later
    such scrape that sees fewer running lowers it by one at most, so a scrape between one
    sequence ending and the next starting does not halve it; one that sees more raises it at
    once. None until the pod was seen with requests waiting: it has had room so far."""
    max_running: float = 0.0
    """The most sequences any scrape saw the pod run."""
    open_at_scrape: int = 0
    """:attr:`in_flight` when the last good scrape was recorded."""
    unread: int = 0
    """Requests of this replica's whose stream extproc did not read, that ended here (at their
    response headers, or up to the stream's end) since the last scrape: they may still run,
    so flow control counts them until the next scrape shows the pod's own figures."""
    recent: int = 0
    """How many of the pool's last :data:`SHARE_WINDOW` picks went to the pod."""
    failed_answers: int = 0
    """Picked requests in a row the pod answered with a 5xx."""
    ejections: int = 0
    """Ejections in a row (no good answer since): the next one lasts twice as long. A pod back
    from one needs :data:`EJECT_AFTER` new failures to go again (those while out do not count)."""
    ejections_total: int = 0
    ejected_until: float = 0.0
    """Clock time the pod's ejection ends (0: never ejected)."""

    def capacity_estimate(self, pool_slots: float | None = None,
                          metrics: PodMetrics | None = None) -> float:
        """:attr:`capacity` once seen; before that the pool's median seen capacity
        (``pool_slots``: the pods of one pool run alike until seen not to), or
        :data:`CAPACITY_GUESS` when no pod of the pool was seen full; at least what it was seen
        running. So a burst between two scrapes spreads instead of piling onto the pod that
        looked best. A pod never seen full whose fresh ``metrics`` show requests waiting is full
        now, at what it runs (at least 1), whatever a guess says."""
        if self.capacity is not None:
            return self.capacity
        if metrics is not None and metrics.waiting > 0.0:
            return metrics.running if metrics.running > 1.0 else 1.0
        guess = pool_slots if pool_slots is not None else CAPACITY_GUESS
        return self.max_running if self.max_running > guess else guess

    @property
    def unreachable(self) -> bool:
        """The scraper could not connect on the last :data:`UNREACHABLE_AFTER` scrapes."""
        return self.connect_failures >= UNREACHABLE_AFTER

    def avoided(self, now: float) -> bool:
        """Ranked after every other pod: unreachable, or ejected for failing its answers."""
        return self.unreachable or now < self.ejected_until


BACKLOG_ALPHA = 0.02
"""Weight of each new request's output budget in a pool's mean (about the last 50 requests)."""


def _mean(mean: float, value: int) -> float:
    """``mean`` moved towards ``value`` by :data:`BACKLOG_ALPHA` (``value`` itself when
    ``mean`` is 0: nothing seen yet)."""
    return float(value) if mean == 0.0 else mean + BACKLOG_ALPHA * (value - mean)


@dataclass
class PoolState:
    """The pods of one pool, by address, in the order DNS or the YAML gave them."""

    cluster: str
    stale_s: float
    pods: dict[str, PodState] = field(default_factory=dict)
    backlog_tokens: float = 0.0
    """The mean output budget of the requests picked for this pool (0 before the first): what
    a request queued ahead of a new one will generate, roughly."""
    prompt_mean: float = 0.0
    """The mean prompt tokens of the requests picked for this pool (0 before the first)."""
    window: deque[PodState] = field(default_factory=lambda: deque(maxlen=SHARE_WINDOW))
    """The pods of the last :data:`SHARE_WINDOW` picks, oldest first."""
    scrapes: int = 0
    """Good scrapes recorded: what :meth:`medians` is cached by."""
    _medians: tuple[int, float | None, float | None] = (-1, None, None)

    def medians(self) -> tuple[float | None, float | None]:
        """The median measured pace (seconds per output token) and the median capacity
        (sequences) of the pool's pods; None where no pod's is known. Cached until the next
        scrape: every pick reads them."""
        at, pace, slots = self._medians
        if at != self.scrapes:
            paces = sorted([p.tpot_s for p in self.pods.values() if p.tpot_s is not None])
            seen = sorted([p.capacity for p in self.pods.values() if p.capacity is not None])
            pace = paces[len(paces) // 2] if paces else None
            slots = seen[len(seen) // 2] if seen else None
            self._medians = (self.scrapes, pace, slots)
        return pace, slots

    def note(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request of ``prompt_tokens`` asking for ``output_tokens`` (0: not said) is being
        picked for: both enter the pool's means."""
        self.prompt_mean = _mean(self.prompt_mean, prompt_tokens)
        if output_tokens > 0:
            self.backlog_tokens = _mean(self.backlog_tokens, output_tokens)

    def set_addresses(self, addresses: list[str]) -> None:
        """The pool's pods are now ``addresses``; known pods keep their state."""
        self.pods = {a: self.pods.get(a) or PodState(a) for a in addresses}

    def record_scrape(self, address: str, metrics: PodMetrics, now: float) -> None:
        pod = self.pods.get(address)
        if pod is None:
            return  # resolved away while the scrape was in flight
        if pod.metrics is not None:
            queries = metrics.prefix_queries - pod.metrics.prefix_queries
            hits = metrics.prefix_hits - pod.metrics.prefix_hits
            if queries > 0 and hits >= 0:
                pod.prefix_hit_rate = min(1.0, hits / queries)
            # An interval with no new tokens says nothing about speed; fewer tokens than before
            # is a restarted pod (counters reset): skip that interval, the next one measures.
            tokens = metrics.token_gap_count - pod.metrics.token_gap_count
            seconds = metrics.token_gap_sum - pod.metrics.token_gap_sum
            if tokens > 0 and seconds >= 0:
                gap = max(seconds / tokens, MIN_TPOT_S)
                pod.tpot_s = gap if pod.tpot_s is None else (
                    pod.tpot_s + TPOT_ALPHA * (gap - pod.tpot_s))
        running = metrics.running
        if running > pod.max_running:
            pod.max_running = running
        if metrics.waiting > 0 and running > 0:
            pod.capacity = running if pod.capacity is None else max(running, pod.capacity - 1.0)
        elif pod.capacity is not None and running > pod.capacity:
            pod.capacity = running
        pod.metrics, pod.scraped_at, pod.failures, pod.sent_since_scrape = metrics, now, 0, 0
        pod.open_at_scrape = pod.in_flight
        pod.unread = 0
        self.scrapes += 1
        pod.connect_failures = 0

    def record_failure(self, address: str, *, connect: bool = False) -> None:
        """A failed scrape; ``connect``: no connection could be made (else the pod answered,
        badly: its metrics are broken, not the pod unreachable)."""
        pod = self.pods.get(address)
        if pod is not None:
            pod.failures += 1
            pod.failures_total += 1
            pod.connect_failures = pod.connect_failures + 1 if connect else 0

    def fresh(self, pod: PodState, now: float) -> PodMetrics | None:
        """The pod's metrics if recent enough to trust, else None (unknown)."""
        if pod.scraped_at is None or now - pod.scraped_at > self.stale_s:
            return None
        return pod.metrics

    def record_answer(self, address: str, failed: bool, now: float) -> bool:
        """The pod answered a picked request, with a 5xx (``failed``) or not; True when this
        answer ejected it. A good answer ends the run of failures and of ejections."""
        pod = self.pods.get(address)
        if pod is None:
            return False
        if not failed:
            pod.failed_answers = 0
            if now >= pod.ejected_until:
                pod.ejections = 0
            return False
        if now < pod.ejected_until:
            return False  # answers to requests picked before (or as a last fallback): not counted
        pod.failed_answers += 1
        if pod.failed_answers < EJECT_AFTER:
            return False
        out = sum(1 for p in self.pods.values() if now < p.ejected_until)
        if out + 1 > max(1, int(len(self.pods) * MAX_EJECTED_SHARE)):
            return False  # the run goes on: ejected as soon as another pod comes back
        pod.failed_answers = 0
        pod.ejections += 1
        pod.ejections_total += 1
        pod.ejected_until = now + min(EJECT_MAX_S, EJECT_BASE_S * 2 ** min(pod.ejections - 1, 16))
        return True

    def sent(self, address: str) -> None:
        """This replica sent the pod a request (counted until its next scrape, and open)."""
        pod = self.pods.get(address)
        if pod is not None:
            pod.sent_since_scrape += 1
            pod.in_flight += 1
            window = self.window
            if len(window) == SHARE_WINDOW:
                window[0].recent -= 1
            window.append(pod)
            pod.recent += 1

    def done(self, address: str, unread: bool = False) -> None:
        """A request this replica sent the pod ended (answered, failed or aborted); ``unread``:
        its response was not read, so its end here is not the pod's (:attr:`PodState.unread`)."""
        pod = self.pods.get(address)
        if pod is not None and pod.in_flight > 0:
            pod.in_flight -= 1
            if unread:
                pod.unread += 1
