from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from extproc.picker.pick import EndpointPicker, Pick, Priority
from extproc.picker.prefix import BLOCK_BYTES, MAX_BLOCKS, PrefixIndex
from extproc.picker.state import PodMetrics

PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]


def config(clusters: dict[str, Any] | None = None) -> Any:
    from routing.schema import RoutingConfig

    clusters = clusters or {"pool": {"endpoints": PODS, "max_context": 32768, "endpoint_picker": {}}}
    return RoutingConfig.model_validate({
        "version": 1, "clusters": clusters, "models": {"m": {"clusters": list(clusters)}},
    })


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def picker(clusters: dict[str, Any] | None = None, seed: int = 1) -> tuple[EndpointPicker, Clock]:
    clock = Clock()
    return EndpointPicker(config(clusters), clock=clock, rng=random.Random(seed)), clock


def scrape(p: EndpointPicker, now: float, cluster: str = "pool", **metrics: PodMetrics) -> None:
    """Every pod of the pool scraped at ``now``: idle unless named (by its last octet, ``p3=``)."""
    pool = p.pools[cluster]
    for address in pool.pods:
        name = "p" + address.split(":")[0].rsplit(".", 1)[1]
        pool.record_scrape(address, metrics.get(name, PodMetrics()), now)


def prompt(seed: int, size: int = 8192) -> bytes:
    return f"conversation {seed} ".encode().ljust(size, b".")


def test_a_cluster_without_picker_gets_none() -> None:
    p, _ = picker({"pool": {"endpoints": PODS, "max_context": 8},
                   "other": {"endpoints": PODS, "max_context": 9}})
    assert p.pools == {}
    assert p.pick("pool", prompt(1), "high") is None
    assert p.pick("nowhere", prompt(1), "high") is None
    p.done("pool", PODS[0])  # nothing to count: no error


def test_a_burst_between_scrapes_spreads_over_equal_pods() -> None:
    p, clock = picker()
    scrape(p, clock.now)
    got: Counter[str | None] = Counter()
    for i in range(100):
        result = p.pick("pool", prompt(i), "medium")
        assert result is not None and result.endpoint is not None
        got[result.endpoint] += 1
    assert set(got) == set(PODS) and all(15 <= n <= 35 for n in got.values()), got
    assert [p.pools["pool"].pods[a].sent_since_scrape for a in PODS] == [got[a] for a in PODS]


def test_one_prompt_sent_in_a_burst_does_not_herd_onto_its_pod() -> None:
    # A client repeating one long prompt: affinity draws it to one pod only while that pod has room.
    p, clock = picker()
    scrape(p, clock.now)
    got = Counter(p.pick("pool", prompt(7), "medium").endpoint for _ in range(100))  # type: ignore[union-attr]
    assert set(got) == set(PODS) and all(15 <= n <= 35 for n in got.values()), got


def test_a_burst_onto_unknown_pods_spreads_too() -> None:
    p, _ = picker()  # never scraped
    got: Counter[str | None] = Counter()
    for i in range(100):
        result = p.pick("pool", prompt(i), "low")
        assert result is not None and result.reason == "unknown"
        got[result.endpoint] += 1
    assert all(15 <= n <= 35 for n in got.values()), got


def test_the_same_prompt_returns_to_its_pod_and_different_prompts_spread() -> None:
    p, clock = picker()
    scrape(p, clock.now)
    homes: dict[int, str] = {}
    for i in range(40):
        first = p.pick("pool", prompt(i), "medium")
        assert first is not None and first.endpoint is not None and first.reason == "scored"
        homes[i] = first.endpoint
        p.done("pool", first.endpoint)
        clock.now += 0.1
        scrape(p, clock.now)
    spread = Counter(homes.values())
    assert set(spread) == set(PODS) and max(spread.values()) <= 20, spread
    for i in range(40):
        again = p.pick("pool", prompt(i), "medium")
        # The next turn of the conversation: the same text plus more.
        longer = p.pick("pool", prompt(i) + b" and a follow-up question" * 40, "medium")
        assert again is not None and (again.endpoint, again.reason) == (homes[i], "prefix")
        assert longer is not None and longer.endpoint == homes[i] and longer.reason == "prefix"
        p.done("pool", homes[i])
        p.done("pool", homes[i])
        clock.now += 0.1
        scrape(p, clock.now)


def test_prefix_affinity_gives_way_to_a_deep_queue() -> None:
    p, clock = picker()
    scrape(p, clock.now)
    home = p.pick("pool", prompt(1), "medium")
    assert home is not None and home.endpoint is not None
    p.done("pool", home.endpoint)
    name = "p" + home.endpoint.split(":")[0].rsplit(".", 1)[1]
    scrape(p, clock.now, "pool", **{name: PodMetrics(waiting=40)})
    moved = p.pick("pool", prompt(1), "medium")
    assert moved is not None and moved.endpoint != home.endpoint and moved.reason == "scored"


def test_traffic_follows_the_metrics() -> None:
    p, clock = picker()
    scrape(p, clock.now, p1=PodMetrics(waiting=40), p2=PodMetrics(kv_usage=0.99), p3=PodMetrics(waiting=20))
    got: Counter[str | None] = Counter()
    for i in range(20):
        result = p.pick("pool", prompt(i), "high")
        assert result is not None and result.endpoint is not None
        got[result.endpoint] += 1
        p.done("pool", result.endpoint)
    assert got == {PODS[3]: 20}
    clock.now += 0.1
    scrape(p, clock.now, p4=PodMetrics(waiting=40))
    result = p.pick("pool", prompt(100), "high")
    assert result is not None and result.endpoint != PODS[3]


def test_stale_metrics_make_a_pod_unknown() -> None:
    p, clock = picker()
    scrape(p, clock.now, p1=PodMetrics(waiting=40), p2=PodMetrics(waiting=40), p3=PodMetrics(waiting=40),
           p4=PodMetrics(waiting=40))
    assert p.pick("pool", prompt(1), "low") == Pick(None, (), "saturated", True)
    clock.now += 2.5  # stale_after defaults to 2s
    fresh = p.pick("pool", prompt(1), "low")
    assert fresh is not None and fresh.reason == "unknown" and not fresh.shed


def test_a_shed_request_is_neither_counted_nor_remembered() -> None:
    p, clock = picker()
    full = PodMetrics(kv_usage=0.99)
    scrape(p, clock.now, p1=full, p2=full, p3=full, p4=full)
    assert p.pick("pool", prompt(1), "low") == Pick(None, (), "saturated", True)
    assert all(pod.sent_since_scrape == 0 and pod.in_flight == 0 for pod in p.pools["pool"].pods.values())
    assert len(p.index) == 0
    priorities: tuple[Priority, ...] = ("medium", "high")
    for priority in priorities:
        served = p.pick("pool", prompt(1), priority)
        assert served is not None and served.endpoint in PODS and not served.shed


def test_pick_counts_sent_and_done_closes() -> None:
    p, clock = picker()
    scrape(p, clock.now)
    result = p.pick("pool", prompt(1), "medium")
    assert result is not None and result.endpoint is not None
    pod = p.pools["pool"].pods[result.endpoint]
    assert (pod.sent_since_scrape, pod.in_flight) == (1, 1)
    p.done("pool", result.endpoint)
    p.done("pool", result.endpoint)  # a second end never goes below zero
    assert (pod.sent_since_scrape, pod.in_flight) == (1, 0)


@pytest.mark.parametrize("size", [0, BLOCK_BYTES - 1, BLOCK_BYTES * MAX_BLOCKS, 1 << 20])
def test_any_prompt_size_picks_and_records_a_bounded_number_of_blocks(size: int) -> None:
    p, clock = picker()
    scrape(p, clock.now)
    result = p.pick("pool", b"q" * size, "medium")
    assert result is not None and result.endpoint in PODS
    assert len(p.index) == min(size // BLOCK_BYTES, MAX_BLOCKS)


def test_pools_only_get_ip_literals_until_the_scraper_resolves_names() -> None:
    p, _ = picker({"pool": {"endpoints": ["10.0.0.1:8000", "vllm.llm.svc:8000", "[fd00::1]:8000"],
                            "max_context": 8, "endpoint_picker": {}}})
    assert list(p.pools["pool"].pods) == ["10.0.0.1:8000", "[fd00::1]:8000"]


def test_names_only_pool_has_no_endpoints_until_resolved() -> None:
    p, _ = picker({"pool": {"endpoints": ["vllm.llm.svc:8000"], "max_context": 8, "endpoint_picker": {}}})
    assert p.pick("pool", prompt(1), "low") == Pick(None, (), "no_endpoints", False)
    p.pools["pool"].set_addresses(["10.1.0.7:8000"])
    result = p.pick("pool", prompt(1), "low")
    assert result is not None and result.endpoint == "10.1.0.7:8000"


def test_a_reload_keeps_the_state_of_pods_that_remain() -> None:
    p, clock = picker()
    index = p.index
    scrape(p, clock.now, p1=PodMetrics(waiting=3))
    pool = p.pools["pool"]
    pool.sent(PODS[0])
    p.update(config({"pool": {"endpoints": [*PODS[:2], "10.0.0.9:8000"], "max_context": 8,
                              "endpoint_picker": {"stale_after": "5s"}}}))
    assert p.pools["pool"] is pool and p.index is index
    assert list(pool.pods) == [*PODS[:2], "10.0.0.9:8000"]
    kept = pool.pods[PODS[0]]
    assert (kept.metrics, kept.sent_since_scrape, kept.in_flight) == (PodMetrics(waiting=3), 1, 1)
    assert pool.pods["10.0.0.9:8000"].metrics is None and pool.stale_s == 5.0


def test_a_reload_keeps_resolved_pods_while_names_remain() -> None:
    p, _ = picker({"pool": {"endpoints": ["vllm.llm.svc:8000", "10.0.0.1:8000"], "max_context": 8,
                            "endpoint_picker": {}}})
    p.pools["pool"].set_addresses(["10.1.0.7:8000", "10.1.0.8:8000", "10.0.0.1:8000"])
    p.update(config({"pool": {"endpoints": ["vllm.llm.svc:8000"], "max_context": 8, "endpoint_picker": {}}}))
    # The literal left the YAML; the pods resolved from the name stay until the next resolution.
    assert sorted(p.pools["pool"].pods) == ["10.1.0.7:8000", "10.1.0.8:8000"]
    p.update(config({"pool": {"endpoints": ["10.0.0.2:8000"], "max_context": 8, "endpoint_picker": {}}}))
    assert list(p.pools["pool"].pods) == ["10.0.0.2:8000"]


def test_a_reload_with_unchanged_endpoints_keeps_resolved_addresses() -> None:
    clusters = {"pool": {"endpoints": ["vllm.llm.svc:8000"], "max_context": 8, "endpoint_picker": {}}}
    p, _ = picker(clusters)
    p.pools["pool"].set_addresses(["10.1.0.7:8000"])
    p.update(config(clusters))
    assert list(p.pools["pool"].pods) == ["10.1.0.7:8000"]


def test_a_reload_drops_clusters_that_lose_the_picker() -> None:
    p, _ = picker({"pool": {"endpoints": PODS, "max_context": 8, "endpoint_picker": {}},
                   "other": {"endpoints": PODS, "max_context": 9, "endpoint_picker": {}}})
    p.update(config({"pool": {"endpoints": PODS, "max_context": 8},
                     "other": {"endpoints": PODS, "max_context": 9, "endpoint_picker": {}}}))
    assert list(p.pools) == ["other"]
    assert p.pick("pool", prompt(1), "high") is None


def test_clusters_do_not_share_prefix_affinity() -> None:
    both = {name: {"endpoints": PODS, "max_context": 8, "endpoint_picker": {}} for name in ("a", "b")}
    p, clock = picker(both)
    scrape(p, clock.now, "a")
    scrape(p, clock.now, "b")
    first = p.pick("a", prompt(1), "medium")
    other = p.pick("b", prompt(1), "medium")
    assert first is not None and first.reason == "scored"
    assert other is not None and other.reason == "scored"


def test_an_injected_index_is_used() -> None:
    index = PrefixIndex(max_entries=10)
    p = EndpointPicker(config(), index=index)
    scrape(p, 0.0)
    p.pick("pool", prompt(1), "medium")
    assert len(index) == 10


def firsts(p: EndpointPicker, n: int = 100) -> Counter[str | None]:
    """The first pick of ``n`` requests of distinct prompts (each closed at once)."""
    got: Counter[str | None] = Counter()
    for i in range(n):
        result = p.pick("pool", prompt(i), "medium")
        assert result is not None and result.endpoint is not None
        got[result.endpoint] += 1
        p.done("pool", result.endpoint)
    return got


def test_a_pod_unreachable_twice_in_a_row_is_never_picked_first() -> None:
    p, clock = picker()
    scrape(p, clock.now, p2=PodMetrics(waiting=20), p3=PodMetrics(waiting=20),
           p4=PodMetrics(waiting=20))
    pool = p.pools["pool"]
    pool.record_failure(PODS[0], connect=True)  # one refused connect may be a blip
    assert not pool.pods[PODS[0]].unreachable
    assert firsts(p, 5) == {PODS[0]: 5}  # its metrics are still fresh and the best
    pool.record_failure(PODS[0], connect=True)
    assert pool.pods[PODS[0]].unreachable
    got = firsts(p)
    assert PODS[0] not in got and sum(got.values()) == 100, got
    # Still a candidate: the last fallback when the reachable pods leave room.
    only = p.pick("pool", prompt(1), "medium")
    assert only is not None and PODS[0] not in only.fallbacks  # three reachable fill the list
    # Back: one good scrape and it is the best pod again.
    pool.record_scrape(PODS[0], PodMetrics(), clock.now)
    assert firsts(p, 5) == {PODS[0]: 5}


def test_an_http_failure_clears_unreachable_and_the_pod_gets_traffic() -> None:
    p, clock = picker()
    scrape(p, clock.now, p2=PodMetrics(waiting=20), p3=PodMetrics(waiting=20),
           p4=PodMetrics(waiting=20))
    pool = p.pools["pool"]
    for _ in range(3):
        pool.record_failure(PODS[0], connect=True)
    pool.record_failure(PODS[0])  # it answers again (a 500): unknown, not unreachable
    assert not pool.pods[PODS[0]].unreachable and pool.pods[PODS[0]].connect_failures == 0
    for _ in range(10):
        pool.record_failure(PODS[0])
    clock.now += 2.5  # its metrics stale (unknown); the others scraped again, busy
    for address in PODS[1:]:
        pool.record_scrape(address, PodMetrics(waiting=20, kv_usage=0.9), clock.now)
    assert pool.fresh(pool.pods[PODS[0]], clock.now) is None
    assert firsts(p, 10) == {PODS[0]: 10}  # unknown beats three busy pods


def test_every_pod_unreachable_still_picks() -> None:
    p, clock = picker()
    scrape(p, clock.now)
    for address in PODS:
        for _ in range(2):
            p.pools["pool"].record_failure(address, connect=True)
    got = firsts(p)
    assert set(got) == set(PODS), got


def test_measured_speed_steers_picks_when_weighted() -> None:
    p, clock = picker({"pool": {"endpoints": PODS, "max_context": 32768,
                                "endpoint_picker": {"weights": {
                                    "latency": 0, "queue": 1, "kv_cache": 1, "in_flight": 0.5,
                                    "prefix": 2, "speed": 1}}}})
    # Two scrapes of token counters: .1 takes 10 ms a token, the others 40 ms.
    for i in (1, 2):
        clock.now += 0.1
        scrape(p, clock.now, p1=PodMetrics(token_gap_sum=0.01 * 100 * i, token_gap_count=100 * i),
               p2=PodMetrics(token_gap_sum=0.04 * 100 * i, token_gap_count=100 * i),
               p3=PodMetrics(token_gap_sum=0.04 * 100 * i, token_gap_count=100 * i),
               p4=PodMetrics(token_gap_sum=0.04 * 100 * i, token_gap_count=100 * i))
    assert p.pools["pool"].pods[PODS[0]].tpot_s == pytest.approx(0.01)
    first = p.pick("pool", prompt(1), "high")
    assert first is not None and first.endpoint == PODS[0]
    # What it is sent before the next scrape raises its cost (10 ms x (1 + sent)): past 4
    # requests the slower idle pods cost less, so a burst spreads instead of piling up on it.
    picked = Counter(getattr(p.pick("pool", prompt(n), "high"), "endpoint", None) for n in range(2, 9))
    assert picked[PODS[0]] < 7 and set(picked) > {PODS[0]}
