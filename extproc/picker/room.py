"""Whether a pod can start one more request now: flow control's test (docs: Flow control).

A pod has room when the sequences on it, as best this replica knows, are fewer than it runs at
once. This replica's own requests are counted exactly when their responses are read to the end
(``in_flight``: a flow-controlled pool reads those sent into its last free slots, and every
request that waited); one whose response was not read counts until the next scrape after its
ext_proc stream ends (``unread``), which then shows it in the pod's own figures. The other
replicas' count only as they were at the last scrape. Room the scrape showed free is shared: this
replica takes its share of it (its part of the pod's load at that scrape, at least one request), so N
replicas that all saw one free slot overshoot it by at most N - 1 until the next scrape, not by
N times the free room. Room its own requests free is its own at once.
"""

from __future__ import annotations

from extproc.picker.state import CAPACITY_GUESS, PodMetrics, PodState

GROWTH = 2.0
"""A pod never seen full is taken to run this many times the most it was seen running (at
least the pool's median, else :data:`~extproc.picker.state.CAPACITY_GUESS`): held at what it
was seen doing, a pod would never be seen full and a pod of 256 slots would stay at 16 for
good. Growing by a factor finds its real limit in a few scrapes, as TCP's slow start does."""


def flow_capacity(pod: PodState, slots: float | None, metrics: PodMetrics | None,
                  declared: float | None = None) -> float:
    """Sequences ``pod`` runs at once, for flow control: its learned capacity; ``running`` when
    its fresh ``metrics`` show requests waiting (it is full now); else the pool's ``declared``
    capacity (``endpoint_picker.max_num_seqs``), or the pool's median ``slots`` or
    :data:`GROWTH` times what it was seen running, whichever is more."""
    if pod.capacity is not None:
        return pod.capacity
    if metrics is not None and metrics.waiting > 0.0:
        return metrics.running if metrics.running > 1.0 else 1.0
    if declared is not None:
        return declared
    grown = GROWTH * pod.max_running
    floor = slots if slots is not None else CAPACITY_GUESS
    return grown if grown > floor else floor


def has_room(pod: PodState, metrics: PodMetrics | None, slots: float | None,
             kv_full: float, declared: float | None = None) -> bool:
    """Can ``pod`` start one more request from this replica? ``metrics``: its fresh scrape
    (None: unknown, judged by this replica's own requests alone); ``slots``: the pool's median
    capacity; ``kv_full``: the KV use at which it is full whatever its sequences; ``declared``:
    the pool's ``max_num_seqs``, if set."""
    capacity = flow_capacity(pod, slots, metrics, declared)
    mine = pod.in_flight + pod.unread
    if metrics is None:
        return mine < capacity
    if metrics.kv_usage is not None and metrics.kv_usage >= kv_full:
        return False
    at_scrape = pod.open_at_scrape
    seen = metrics.running + metrics.waiting
    if seen < at_scrape:
        seen = at_scrape  # sent, not yet on the pod when it was scraped
    free = capacity - seen
    if free <= 0.0:
        # Full at the scrape: only what this replica's own requests freed since.
        return mine < at_scrape + free
    share = at_scrape / seen if seen > 0.0 else 1.0
    quota = share * free
    return mine < at_scrape + (quota if quota > 1.0 else 1.0)
