"""When a pod can start one more request from this replica: flow control's test (see
extproc/picker/room.py). Its own requests count exactly, the other replicas' as at the last
scrape, and the room a scrape showed is shared."""

from __future__ import annotations

import random

import pytest

from extproc.picker.pick import EndpointPicker
from extproc.picker.room import flow_capacity, has_room
from extproc.picker.state import CAPACITY_GUESS, PodMetrics, PodState, PoolState
from tests.extproc.helpers import BASE, snapshot

KV_FULL = 0.98


def pod(*, capacity: float | None = 6.0, in_flight: int = 0, at_scrape: int = 0,
        max_running: float = 0.0, unread: int = 0) -> PodState:
    state = PodState("10.0.0.1:8000", capacity=capacity, max_running=max_running)
    state.in_flight, state.open_at_scrape, state.unread = in_flight, at_scrape, unread
    return state


@pytest.mark.parametrize(("state", "metrics", "room"), [
    # One replica: full at the scrape, room as soon as one of its own requests ends.
    (pod(in_flight=6, at_scrape=6), PodMetrics(running=6), False),
    (pod(in_flight=5, at_scrape=6), PodMetrics(running=6), True),
    # The pod had requests waiting: this replica's ending ones free the waiting ones' slots.
    (pod(in_flight=5, at_scrape=6), PodMetrics(running=6, waiting=2), False),
    (pod(in_flight=3, at_scrape=6), PodMetrics(running=6, waiting=2), True),
    # Two replicas, three each on a full pod: only this replica's own ending frees its room.
    (pod(in_flight=3, at_scrape=3), PodMetrics(running=6), False),
    (pod(in_flight=2, at_scrape=3), PodMetrics(running=6), True),
    # Two free slots seen by two replicas of equal load: this one takes its half (one).
    (pod(capacity=8, in_flight=3, at_scrape=3), PodMetrics(running=6), True),
    (pod(capacity=8, in_flight=4, at_scrape=3), PodMetrics(running=6), False),
    # An idle pod is all this replica's to fill (nobody else's load was seen).
    (pod(capacity=8, in_flight=7), PodMetrics(), True),
    (pod(capacity=8, in_flight=8), PodMetrics(), False),
    # A replica with nothing on a busy pod still gets one of its free slots.
    (pod(capacity=8, in_flight=0), PodMetrics(running=6), True),
    (pod(capacity=8, in_flight=1), PodMetrics(running=6), False),
    # Sent but not on the pod yet at the scrape: counted as this replica's, not twice.
    (pod(in_flight=5, at_scrape=5), PodMetrics(running=3), True),
    (pod(in_flight=6, at_scrape=6), PodMetrics(running=3), False),
    # A full KV cache is no room, whatever the sequences.
    (pod(in_flight=0), PodMetrics(running=1, kv_usage=0.99), False),
    # A pod whose engine has no KV gauge is judged by its sequences.
    (pod(in_flight=0), PodMetrics(running=1, kv_usage=None), True),
    # A request whose response was not read ended its stream, not necessarily its run: it
    # counts until the next scrape (which resets it), so no room appears for it.
    (pod(in_flight=5, at_scrape=6, unread=1), PodMetrics(running=6), False),
    (pod(in_flight=4, at_scrape=6, unread=1), PodMetrics(running=6), True),
    # Unknown (no fresh metrics): this replica's own requests against the capacity.
    (pod(in_flight=5), None, True),
    (pod(in_flight=6), None, False),
])
def test_room(state: PodState, metrics: PodMetrics | None, room: bool) -> None:
    assert has_room(state, metrics, None, KV_FULL) is room


@pytest.mark.parametrize(("state", "slots", "metrics", "capacity"), [
    (pod(capacity=6.0, max_running=9), None, None, 6.0),  # learned: as learned
    (pod(capacity=None), None, PodMetrics(running=5, waiting=3), 5.0),  # full now
    (pod(capacity=None), None, PodMetrics(running=0, waiting=3), 1.0),
    (pod(capacity=None), None, None, CAPACITY_GUESS),  # never seen: the guess
    (pod(capacity=None), 10.0, None, 10.0),  # or the pool's median
    # Seen running at its estimate without a queue: twice that, so it can be seen full.
    (pod(capacity=None, max_running=16), None, PodMetrics(running=16), 32.0),
    (pod(capacity=None, max_running=64), 10.0, None, 128.0),
])
def test_capacity(state: PodState, slots: float | None, metrics: PodMetrics | None,
                  capacity: float) -> None:
    assert flow_capacity(state, slots, metrics) == capacity


@pytest.mark.parametrize(("state", "metrics", "capacity"), [
    # Never seen full: the declared max_num_seqs, neither the guess nor twice what it ran.
    (pod(capacity=None), None, 6.0),
    (pod(capacity=None, max_running=6), PodMetrics(running=6), 6.0),
    # Seen full at fewer (the KV cache bound first): what it ran, now and once learned.
    (pod(capacity=None), PodMetrics(running=4, waiting=2), 4.0),
    (pod(capacity=4.0), None, 4.0),
])
def test_a_declared_capacity_is_taken_until_the_pod_shows_less(
        state: PodState, metrics: PodMetrics | None, capacity: float) -> None:
    assert flow_capacity(state, 10.0, metrics, declared=6.0) == capacity


def test_a_pool_that_declares_its_pods_max_num_seqs_never_overfills_them_while_learning() -> None:
    """Without ``max_num_seqs`` a fresh pool of 2-sequence pods takes 16 requests per pod before
    a scrape shows any full; with it, two per pod, and then requests wait."""
    def picker_of(picker: dict[str, object], **cluster: object) -> EndpointPicker:
        snap = snapshot(clusters={**BASE["clusters"], "vllm-short": {
            "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"], "max_context": 2048,
            "endpoint_picker": {"flow_control": {}, **picker}, **cluster}})
        return EndpointPicker(snap.config, clock=lambda: 1.0, rng=random.Random(1))

    def taken(picker: EndpointPicker) -> int:
        sent = 0
        while picker.has_room("vllm-short") and sent < 100:
            assert picker.pick("vllm-short", f"p{sent}".encode(), "high", room_only=True)
            sent += 1
        return sent

    assert taken(picker_of({"max_num_seqs": 2})) == 4
    assert taken(picker_of({})) == 2 * int(CAPACITY_GUESS)
    # Simulated pods declare their own; the picker's setting, when given, wins.
    assert taken(picker_of({}, simulate={"max_num_seqs": 2})) == 4
    assert taken(picker_of({"max_num_seqs": 3}, simulate={"max_num_seqs": 2})) == 6
    assert taken(picker_of({}, simulate=True)) == 2 * int(CAPACITY_GUESS)


def test_a_scrape_forgets_the_unread_ends_and_a_read_end_frees_at_once() -> None:
    pool = PoolState("pool", 2.0)
    pool.set_addresses(["p"])
    pool.record_scrape("p", PodMetrics(running=6, waiting=1), 0.0)  # learns 6 slots
    for _ in range(6):
        pool.sent("p")
    pool.record_scrape("p", PodMetrics(running=6), 1.0)
    state = pool.pods["p"]
    pool.done("p", unread=True)
    assert not has_room(state, PodMetrics(running=6), None, KV_FULL)  # may still run
    pool.done("p")  # read to its end: the slot is free
    assert has_room(state, PodMetrics(running=6), None, KV_FULL)
    # The next scrape shows the unread one still running (5 in all, 4 of them read ones still
    # open): it is the pod's own figure now, and one slot is free.
    pool.record_scrape("p", PodMetrics(running=5), 2.0)
    assert state.unread == 0 and has_room(state, state.metrics, None, KV_FULL)


def test_the_pick_that_takes_a_pods_last_free_slot_says_so() -> None:
    snap = snapshot(clusters={**BASE["clusters"], "vllm-short": {
        "endpoints": ["10.0.0.1:8000"], "max_context": 2048,
        "endpoint_picker": {"flow_control": {}}}})
    picker = EndpointPicker(snap.config, clock=lambda: 1.0, rng=random.Random(1))
    pool = picker.pools["vllm-short"]
    pool.record_scrape("10.0.0.1:8000", PodMetrics(running=2, waiting=1), 1.0)  # 2 slots
    pool.record_scrape("10.0.0.1:8000", PodMetrics(running=0), 1.0)
    first = picker.pick("vllm-short", b"a", "high", room_only=True)
    second = picker.pick("vllm-short", b"b", "high", room_only=True)
    assert first is not None and second is not None
    assert (first.fills, second.fills) == (False, True)
    assert not picker.has_room("vllm-short")
