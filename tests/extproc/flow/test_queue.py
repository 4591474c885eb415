"""The waiting line of one pool: bands, tenants in turn, bounds (docs: Flow control)."""

from __future__ import annotations

import random

import pytest

from extproc.flow.queue import FlowQueue, Ticket

HIGH, MEDIUM, LOW = 0, 1, 2


def ticket(name: str, band: int = LOW, tenant: str = "t", size: int = 100) -> Ticket[str]:
    return Ticket(band, tenant, size, name)


def drain(queue: FlowQueue[str]) -> list[str]:
    out: list[str] = []
    while (next_one := queue.pop()) is not None:
        out.append(next_one.item)
    return out


def drain_one(queue: FlowQueue[str]) -> str:
    next_one = queue.pop()
    assert next_one is not None
    return next_one.item


def test_a_band_is_served_only_while_the_bands_above_it_are_empty() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "none")
    for t in (ticket("low1", LOW), ticket("med1", MEDIUM), ticket("high1", HIGH),
              ticket("low2", LOW), ticket("high2", HIGH)):
        assert queue.add(t) == []
    assert drain(queue) == ["high1", "high2", "med1", "low1", "low2"]


def test_tenants_take_turns_within_a_band() -> None:
    """A tenant with one request waiting is served after at most one request of a tenant with
    eight that came first, not after all eight."""
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "tenant")
    for i in range(8):
        queue.add(ticket(f"loud{i}", tenant="loud"))
    queue.add(ticket("quiet0", tenant="quiet"))
    order = drain(queue)
    assert order.index("quiet0") == 1
    assert [name for name in order if name.startswith("loud")] == [f"loud{i}" for i in range(8)]


def test_without_fairness_it_is_first_come_first_served() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "none")
    for i in range(3):
        queue.add(ticket(f"loud{i}", tenant="loud"))
    queue.add(ticket("quiet0", tenant="quiet"))
    assert drain(queue) == ["loud0", "loud1", "loud2", "quiet0"]


@pytest.mark.parametrize(("waiting", "new", "refused", "left"), [
    # Full with lows: a new high takes the newest low's place.
    ([("l1", LOW), ("l2", LOW)], ("h1", HIGH), ["l2"], ["h1", "l1"]),
    # Full, the new one in the lowest band waiting: it is that band's newest, refused itself.
    ([("h1", HIGH), ("l1", LOW)], ("l2", LOW), ["l2"], ["h1", "l1"]),
    # Full, the new one lower than every band waiting: refused.
    ([("h1", HIGH), ("m1", MEDIUM)], ("l1", LOW), ["l1"], ["h1", "m1"]),
    # Full with highs only, a new high: refused (never a request of a higher band for it).
    ([("h1", HIGH), ("h2", HIGH)], ("h3", HIGH), ["h3"], ["h1", "h2"]),
    # A medium displaces the newest low, not a high.
    ([("h1", HIGH), ("l1", LOW)], ("m1", MEDIUM), ["l1"], ["h1", "m1"]),
])
def test_max_queue_refuses_the_newest_of_the_lowest_band(
        waiting: list[tuple[str, int]], new: tuple[str, int], refused: list[str],
        left: list[str]) -> None:
    queue: FlowQueue[str] = FlowQueue(2, 10**6, "none")
    for name, band in waiting:
        assert queue.add(ticket(name, band)) == []
    assert [t.item for t in queue.add(ticket(*new))] == refused
    assert len(queue) == 2
    assert drain(queue) == left


def test_the_newest_is_found_across_tenants() -> None:
    queue: FlowQueue[str] = FlowQueue(3, 10**6, "tenant")
    queue.add(ticket("a1", tenant="a"))
    queue.add(ticket("b1", tenant="b"))
    queue.add(ticket("a2", tenant="a"))
    assert [t.item for t in queue.add(ticket("h", HIGH, tenant="c"))] == ["a2"]
    assert drain(queue) == ["h", "a1", "b1"]


def test_the_byte_bound_refuses_as_the_count_does() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 1000, "none")
    assert queue.add(ticket("l1", LOW, size=400)) == []
    assert queue.add(ticket("l2", LOW, size=400)) == []
    # 300 more bytes do not fit: the newest low goes for a high...
    assert [t.item for t in queue.add(ticket("h1", HIGH, size=300))] == ["l2"]
    assert queue.bytes == 700
    # ...and a body larger than the whole bound is refused outright, displacing nothing.
    assert [t.item for t in queue.add(ticket("huge", HIGH, size=1001))] == ["huge"]
    assert queue.bytes == 700 and len(queue) == 2
    # One that would not fit even with every lower band gone displaces nobody.
    assert [t.item for t in queue.add(ticket("h2", HIGH, size=900))] == ["h2"]
    assert drain(queue) == ["h1", "l1"]


def test_several_lower_requests_may_go_for_one_large_enough() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 1000, "none")
    for name in ("l1", "l2", "l3"):
        queue.add(ticket(name, LOW, size=300))
    assert [t.item for t in queue.add(ticket("h1", HIGH, size=600))] == ["l3", "l2"]
    assert drain(queue) == ["h1", "l1"]


def test_removal_keeps_counts_and_turns_right() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "tenant")
    a1, a2, b1 = ticket("a1", tenant="a"), ticket("a2", tenant="a"), ticket("b1", tenant="b")
    for t in (a1, a2, b1):
        queue.add(t)
    assert queue.remove(a1) and not queue.remove(a1)
    assert len(queue) == 2 and queue.bytes == 200 and queue.depth(LOW) == 2
    # a2 is a's second request (turn 1), b1 b's first (turn 0).
    assert drain(queue) == ["b1", "a2"]
    assert queue.bytes == 0


def test_a_tenant_that_had_none_waiting_goes_before_the_flooding_tenants_next_request() -> None:
    """Plain rotation would put a newcomer behind the tenant whose turn it is next; the turn
    numbers let it go at the next release, as the issue's quiet tenant needs."""
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "tenant")
    for i in range(8):
        queue.add(ticket(f"loud{i}", tenant="loud"))
    assert drain_one(queue) == "loud0"
    queue.add(ticket("quiet0", tenant="quiet"))
    assert drain_one(queue) == "quiet0"
    assert drain_one(queue) == "loud1"


def test_a_tenant_sending_one_at_a_time_still_takes_turns_with_the_others() -> None:
    """Arriving just before every release does not win every release: a tenant served in the
    current turn joins the next one, behind the other tenants' requests of this turn."""
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "tenant")
    for i in range(6):
        queue.add(ticket(f"a{i}", tenant="a"))
        queue.add(ticket(f"b{i}", tenant="b"))
    served: list[str] = []
    sent, sly_waiting = 0, False
    for _ in range(9):
        if not sly_waiting:  # its next request once the last one went, just before a release
            queue.add(ticket(f"sly{sent}", tenant="sly"))
            sent, sly_waiting = sent + 1, True
        served.append(drain_one(queue))
        sly_waiting = sly_waiting and not served[-1].startswith("sly")
    assert served == ["a0", "b0", "sly0", "a1", "b1", "sly1", "a2", "b2", "sly2"]


def test_every_request_goes_once_in_its_tenants_order_whatever_leaves() -> None:
    """Random joins, releases and departures (clients hanging up, waits running out): counts
    and bytes stay exact, nothing is served twice or lost, each tenant's requests go in the
    order they came."""
    rng = random.Random(37)
    queue: FlowQueue[str] = FlowQueue(10**6, 10**9, "tenant")
    waiting: list[Ticket[str]] = []
    served: list[Ticket[str]] = []
    removed: set[str] = set()
    for step in range(5000):
        roll = rng.random()
        if roll < 0.5 or not waiting:
            t = ticket(f"r{step}", rng.choice((HIGH, LOW)), rng.choice("abcde"), rng.randint(1, 9))
            assert queue.add(t) == []
            waiting.append(t)
        elif roll < 0.65:
            gone = waiting.pop(rng.randrange(len(waiting)))
            assert queue.remove(gone)
            removed.add(gone.item)
        else:
            out = queue.pop()
            assert out is not None and out in waiting
            waiting.remove(out)
            served.append(out)
        assert len(queue) == len(waiting) and queue.bytes == sum(t.size for t in waiting)
    served += [t for t in iter(queue.pop, None)]
    assert len(queue) == 0 and queue.bytes == 0
    names = [t.item for t in served]
    assert len(names) == len(set(names)) and not removed & set(names)
    for tenant in "abcde":
        for band in (HIGH, LOW):
            mine = [t.seq for t in served if t.tenant == tenant and t.band == band]
            assert mine == sorted(mine)


def test_a_reload_that_changes_fairness_still_finds_the_waiting() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 10**6, "tenant")
    waiting = ticket("a1", tenant="a")
    queue.add(waiting)
    queue.fairness = "none"
    queue.add(ticket("b1", tenant="b"))
    assert queue.remove(waiting)
    assert drain(queue) == ["b1"]


def test_with_tenant_fairness_a_flooding_tenant_loses_its_own_newest() -> None:
    """A full queue refuses the newest request of the tenant with the most waiting in the
    lowest band: one tenant's flood cannot crowd another tenant's first request out."""
    queue: FlowQueue[str] = FlowQueue(4, 10**6, "tenant")
    for i in range(3):
        queue.add(ticket(f"loud{i}", tenant="loud"))
    queue.add(ticket("calm0", tenant="calm"))
    assert [t.item for t in queue.add(ticket("quiet0", tenant="quiet"))] == ["loud2"]
    # The flooding tenant's next request is refused itself.
    assert [t.item for t in queue.add(ticket("loud3", tenant="loud"))] == ["loud3"]
    assert sorted(drain(queue)) == ["calm0", "loud0", "loud1", "quiet0"]


def test_a_request_refused_itself_displaces_nobody_on_the_way() -> None:
    queue: FlowQueue[str] = FlowQueue(100, 1000, "none")
    queue.add(ticket("l1", LOW, size=300))
    queue.add(ticket("h1", HIGH, size=600))
    # 500 bytes of high: refusing l1 is not enough, and h2 is the newest high: l1 stays.
    assert [t.item for t in queue.add(ticket("h2", HIGH, size=500))] == ["h2"]
    assert queue.bytes == 900
    assert drain(queue) == ["h1", "l1"]
