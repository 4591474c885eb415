"""One suite over every BucketStore: memory, a real Redis, and a 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from ratelimit.bucket import BucketSpec, Hit, Settle
from ratelimit.errors import BackendError
from ratelimit.keys import bucket_key
from ratelimit.lua import DECIDE_SHA, REFUND_SHA, SETTLE_SHA
from ratelimit.memory_store import MemoryStore
from ratelimit.redis_store import RedisStore
from ratelimit.store import BucketStore
from sidecar_runtime.redis.client import make_client
from tests.harness.redis_servers import RedisClusterServers
from tests.harness.waits import until

pytestmark = pytest.mark.redis

SLOW = 1e-4  # tokens per second: nothing refills during a test
MARGIN_S = 0.05


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[BucketStore]:
    if request.param == "memory":
        made: BucketStore = MemoryStore(margin_s=MARGIN_S)
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        made = RedisStore(make_client(server.url, 2.0), margin_s=MARGIN_S)
    else:
        cluster = request.getfixturevalue("redis_cluster")
        made = RedisStore(make_client(cluster.url, 2.0), margin_s=MARGIN_S)
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture(params=["memory", "redis"])
async def store_with_short_leases(request: pytest.FixtureRequest) -> AsyncIterator[BucketStore]:
    """Leases of 0.3 s: a holder that never releases (its Envoy died) frees the slot."""
    if request.param == "memory":
        made: BucketStore = MemoryStore(margin_s=MARGIN_S, lease_ttl_s=0.3)
    else:
        server = request.getfixturevalue("redis_server")
        made = RedisStore(make_client(server.url, 2.0), margin_s=MARGIN_S, lease_ttl_s=0.3)
    try:
        yield made
    finally:
        await made.aclose()


def key(name: str) -> str:
    return bucket_key("suite", [("bucket", name)])


def hit(name: str, capacity: float, hits: int = 1, rate: float = SLOW, debt: bool = False) -> Hit:
    return Hit(key(name), BucketSpec(capacity, rate, debt=debt), hits)


async def level(store: BucketStore, name: str, capacity: float, debt: bool = False) -> float:
    """The level, read with a check-only hit (which changes nothing)."""
    result = await store.decide([hit(name, capacity, hits=0, debt=debt)])
    return result.results[0].level


async def exists(store: BucketStore, name: str) -> bool:
    if isinstance(store, MemoryStore):
        store.sweep()
        return key(name) in store._buckets
    assert isinstance(store, RedisStore)
    return bool(await store.client.exists(key(name)))


async def test_admits_exactly_the_limit(store: BucketStore) -> None:
    results = [await store.decide([hit("a", 5)]) for _ in range(8)]
    assert [r.admitted for r in results] == [True] * 5 + [False] * 3


async def test_admits_exactly_the_limit_under_concurrency(store: BucketStore) -> None:
    results = await asyncio.gather(*(store.decide([hit("c", 7)]) for _ in range(40)))
    assert sum(r.admitted for r in results) == 7


async def test_denied_multi_descriptor_request_changes_nothing(store: BucketStore) -> None:
    assert (await store.decide([hit("full", 1)])).admitted  # now empty
    before = [await level(store, name, 5) for name in ("x", "y")]
    request = [hit("x", 5, 2), hit("full", 1), hit("y", 5, 3), hit("z", 4, 1)]
    result = await store.decide(request)
    assert not result.admitted
    assert [r.admitted for r in result.results] == [True, False, True, True]
    assert [await level(store, name, 5) for name in ("x", "y")] == pytest.approx(before)
    assert await level(store, "z", 4) == pytest.approx(4)
    assert await level(store, "full", 1) == pytest.approx(0, abs=1e-3)
    assert (await store.decide([hit("x", 5, 5), hit("y", 5, 5)])).admitted


async def test_check_only_takes_nothing(store: BucketStore) -> None:
    for _ in range(5):
        result = await store.decide([hit("k", 2, hits=0)])
        assert result.admitted and result.results[0].level == pytest.approx(2)
    await store.decide([hit("k", 2, hits=2)])
    assert not (await store.decide([hit("k", 2, hits=0)])).admitted


async def test_debt_goes_negative_and_is_never_refunded(store: BucketStore) -> None:
    assert (await store.decide([hit("t", 10, hits=0, debt=True)])).admitted
    charged = await store.decide([hit("t", 10, hits=50, debt=True)])
    assert charged.admitted and charged.results[0].level == pytest.approx(-40, abs=1e-2)
    assert not (await store.decide([hit("t", 10, hits=0, debt=True)])).admitted
    # A charge that rides along a denied request still applies.
    assert (await store.decide([hit("empty", 1)])).admitted
    mixed = await store.decide([hit("t", 10, hits=5, debt=True), hit("empty", 1)])
    assert not mixed.admitted
    assert await level(store, "t", 10, debt=True) == pytest.approx(-45, abs=1e-2)


async def test_idle_buckets_expire(store: BucketStore) -> None:
    await store.decide([hit("e", 2, rate=20.0)])  # full again after 0.05 s, + 0.05 s margin
    await store.decide([hit("long", 2)])  # full again only after hours
    assert await exists(store, "e")

    async def expired() -> bool:
        return not await exists(store, "e")

    await until(expired, timeout_s=10, what="the idle bucket to expire")
    assert await exists(store, "long")


async def test_keys_of_one_request_span_cluster_slots(store: BucketStore) -> None:
    names = [f"slot-{i}" for i in range(6)]
    if isinstance(store, RedisStore) and hasattr(store.client, "keyslot"):
        assert len({store.client.keyslot(key(n)) for n in names}) > 1
    assert (await store.decide([hit(n, 3) for n in names])).admitted
    await store.decide([hit("slot-5", 3, hits=2)])  # slot-5 is empty now
    denied = await store.decide([hit(n, 3) for n in names])
    assert not denied.admitted
    for n in names[:5]:
        assert await level(store, n, 3) == pytest.approx(2, abs=1e-3)


# Reservations, settlement and concurrency slots (docs: Rate limits): the same on every store.

def reserve(name: str, capacity: float, tokens: int, lease: str) -> Hit:
    return Hit(key(name), BucketSpec(capacity, SLOW), tokens, lease)


def settle(name: str, capacity: float, lease: str, used: int | None) -> Settle:
    spec = BucketSpec(capacity, SLOW, concurrent=used is None)
    return Settle(key(name), spec, lease, used)


def slot(name: str, slots: int, lease: str, shadow: bool = False) -> Hit:
    return Hit(key(name), BucketSpec(slots, 0.0, shadow=shadow, concurrent=True), 1, lease)


async def test_concurrent_reservations_never_overshoot(store: BucketStore) -> None:
    """20 requests arrive together, each reserving 250 of a 1000-token bucket: exactly 4 fit."""
    results = await asyncio.gather(*(
        store.decide([reserve("tok", 1000, 250, f"lease{i:04d}")]) for i in range(20)))
    admitted = [i for i, r in enumerate(results) if r.admitted]
    assert len(admitted) == 4
    # They finish having used 10 tokens each: 240 each go back, so 3 more reservations fit.
    await store.settle([settle("tok", 1000, f"lease{i:04d}", 10) for i in admitted])
    assert await level(store, "tok", 1000) == pytest.approx(1000 - 40, abs=0.01)
    again = await asyncio.gather(*(
        store.decide([reserve("tok", 1000, 250, f"again{i:04d}")]) for i in range(5)))
    assert sum(r.admitted for r in again) == 3


async def test_a_reservation_is_settled_exactly_once(store: BucketStore) -> None:
    assert (await store.decide([reserve("once", 100, 60, "leaseonce")])).admitted
    for _ in range(3):  # a repeated settle (a retried call, a forged one) changes nothing
        await store.settle([settle("once", 100, "leaseonce", 0)])
    assert await level(store, "once", 100) == pytest.approx(100, abs=0.01)


async def test_overage_is_charged_as_debt(store: BucketStore) -> None:
    assert (await store.decide([reserve("over", 100, 30, "leaseover")])).admitted
    await store.settle([settle("over", 100, "leaseover", 150)])  # used 120 more than reserved
    assert await level(store, "over", 100) == pytest.approx(-50, abs=0.01)
    assert not (await store.decide([reserve("over", 100, 1, "leasenext")])).admitted


async def test_a_denied_or_unknown_lease_settles_nothing(store: BucketStore) -> None:
    assert (await store.decide([reserve("deny", 100, 80, "leasefirst")])).admitted
    assert not (await store.decide([reserve("deny", 100, 80, "leasedenied")])).admitted
    await store.settle([settle("deny", 100, "leasedenied", 0), settle("deny", 100, "leasenever", 0)])
    assert await level(store, "deny", 100) == pytest.approx(20, abs=0.01)


async def test_a_request_that_does_not_fit_takes_nothing_anywhere(store: BucketStore) -> None:
    """All or nothing across a requests bucket, a token reservation and a slot."""
    request = [hit("req", 5), reserve("tokens", 100, 101, "leasebig"), slot("conc", 2, "leasebig")]
    assert not (await store.decide(request)).admitted
    assert await level(store, "req", 5) == pytest.approx(5)
    assert await level(store, "tokens", 100) == pytest.approx(100)
    both = [slot("conc", 2, "leasea"), slot("conc", 2, "leaseb")]
    assert all([(await store.decide([s])).admitted for s in both])  # both slots still free


async def test_concurrency_slots_are_held_until_released(store: BucketStore) -> None:
    results = await asyncio.gather(*(store.decide([slot("c3", 3, f"lease{i:04d}")]) for i in range(10)))
    held = [i for i, r in enumerate(results) if r.admitted]
    assert len(held) == 3
    assert not (await store.decide([slot("c3", 3, "leaselate")])).admitted
    await store.settle([settle("c3", 3, f"lease{held[0]:04d}", None)])
    await store.settle([settle("c3", 3, f"lease{held[0]:04d}", None)])  # twice frees one slot
    assert (await store.decide([slot("c3", 3, "leasenew1")])).admitted
    assert not (await store.decide([slot("c3", 3, "leasenew2")])).admitted


async def test_a_shadow_slot_cap_admits_and_counts(store: BucketStore) -> None:
    assert (await store.decide([slot("sh", 1, "leaseone", shadow=True)])).admitted
    over = await store.decide([slot("sh", 1, "leasetwo", shadow=True)])
    assert over.admitted and not over.results[0].admitted


async def test_slots_of_a_dead_holder_expire(store_with_short_leases: BucketStore) -> None:
    store = store_with_short_leases
    assert (await store.decide([slot("dead", 1, "leasedead")])).admitted
    assert not (await store.decide([slot("dead", 1, "leasewait")])).admitted
    deadline = asyncio.get_running_loop().time() + 10
    while not (await store.decide([slot("dead", 1, "leaselive")])).admitted:
        assert asyncio.get_running_loop().time() < deadline, "the slot never expired"
        await asyncio.sleep(0.05)


async def test_on_a_cluster_what_the_other_masters_admitted_is_taken_back_when_one_fails(
        redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's buckets on two slots: one group fails (its master dropped the connection)
    while the other admitted. The request gets ``on_backend_error``, so the slot the other
    took is given back; before, it stayed taken for the lease's 10 minutes."""
    store = RedisStore(make_client(redis_cluster.url, 2.0), margin_s=MARGIN_S)
    slot = BucketSpec(1, 0, concurrent=True)
    kept, lost = key("cap-kept"), key("cap-lost")
    try:
        client = store.client
        assert isinstance(client, RedisCluster) and client.keyslot(kept) != client.keyslot(lost)
        real_run = store._run

        async def run(hits: Sequence[Hit], group: Any) -> Any:
            if hits[group.positions[0]].key == lost:
                raise RedisConnectionError("Connection closed by server.")
            return await real_run(hits, group)
        monkeypatch.setattr(store, "_run", run)
        with pytest.raises(BackendError):
            await store.decide([Hit(kept, slot, 1, "lease-a"), Hit(lost, slot, 1, "lease-a")])
        monkeypatch.undo()
        assert (await store.decide([Hit(kept, slot, 1, "lease-b")])).admitted
        assert not (await store.decide([Hit(kept, slot, 1, "lease-c")])).admitted
    finally:
        await store.aclose()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_connect_leaves_the_first_decision_one_evalsha_on_open_connections(
        kind: str, request: pytest.FixtureRequest) -> None:
    """Start-up opens every master's connection and loads the scripts, so a fresh replica's
    first decision is one ``EVALSHA`` per master on a connection already open. Before, it
    paid TCP, TLS, AUTH and a ``NOSCRIPT`` round trip inside its 50 ms deadline and, on a
    busy machine, got ``on_backend_error`` after every start (a flaky CI run showed it)."""
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        admins = [server.client(socket_timeout=2)]
        url = server.url
    else:
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        admins = [node.client(socket_timeout=2) for node in cluster.nodes]
        url = cluster.url
    for admin in admins:
        admin.script_flush()
    store = RedisStore(make_client(url, 2.0), margin_s=MARGIN_S)
    try:
        await store.connect()
        for admin in admins:
            assert admin.script_exists(DECIDE_SHA, SETTLE_SHA, REFUND_SHA) == [True] * 3
            admin.config_resetstat()
        hits = [hit(name, 5) for name in ("model", "tenant", "key")]  # a request's three
        assert (await store.decide(hits)).admitted
        for admin in admins:
            stats = admin.info("stats")
            commands = admin.info("commandstats")
            assert stats["total_connections_received"] == 0  # the admin's is older
            assert "cmdstat_eval" not in commands
        assert sum(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                   for admin in admins) >= 1
    finally:
        await store.aclose()
        for admin in admins:
            admin.close()


async def test_masters_down_at_start_up_are_marked_down_and_the_other_gets_the_scripts(
        redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch) -> None:
    admins = [node.client(socket_timeout=2) for node in redis_cluster.nodes]
    for admin in admins:
        admin.script_flush()
    store = RedisStore(make_client(redis_cluster.url, 2.0), margin_s=MARGIN_S)
    router = store._router
    assert router is not None
    try:
        await router.ready()
        lost = {f"{node.host}:{node.port}" for node in redis_cluster.nodes[1:]}
        real_send = router._send

        async def send(node: Any, args: Any) -> Any:
            if node.name in lost:
                raise RedisConnectionError("Connection refused.")
            return await real_send(node, args)
        monkeypatch.setattr(router, "_send", send)
        with pytest.raises(BackendError):
            await store.connect()
        assert router.down == lost  # each: its keys get on_backend_error at once; it is probed
        for n, admin in enumerate(admins):
            assert admin.script_exists(DECIDE_SHA) == [n == 0]
    finally:
        monkeypatch.undo()
        await store.aclose()
        for admin in admins:
            admin.close()
