"""The Cluster router against a real 3-master cluster: a dead master fails only its own keys,
at once, without reloading the slot map or touching the other masters' connections, and is
used again once it is writable; a stale slot map follows MOVED and is corrected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from sidecar_runtime.redis.client import make_client
from sidecar_runtime.redis.cluster import ClusterRouter, NodeDownError
from tests.harness.redis_fixtures import serving
from tests.harness.redis_servers import ProcessRedis, RedisClusterServers, start_redis_cluster

pytestmark = pytest.mark.redis

WAIT_S = 15.0
"""Generous: the restarted master itself takes 2 s to become writable (Redis's
CLUSTER_WRITABLE_DELAY); the router asks it every 0.05 s here."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with serving(start_redis_cluster, "redis cluster") as servers:  # its own: one gets killed
        yield servers


@pytest.fixture
async def router(cluster: RedisClusterServers) -> AsyncIterator[ClusterRouter]:
    client = make_client(cluster.url, 0.5)
    assert isinstance(client, RedisCluster)
    made = ClusterRouter(client, probe_interval_s=0.05)
    await made.ready()
    yield made
    await made.aclose()
    await client.aclose()


def key_on(router: ClusterRouter, node: ProcessRedis) -> str:
    return next(k for k in (f"router-test-{i}" for i in range(10_000))
                if router.owner(k).port == node.port)


def cluster_ok(node: ProcessRedis) -> bool:
    try:
        with node.client(socket_timeout=0.5, decode_responses=True) as client:
            return bool(client.cluster("INFO").get("cluster_state") == "ok")
    except Exception:  # still starting
        return False


async def wait_for(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S:g} s")
        await asyncio.sleep(0.02)


async def test_a_dead_master_fails_only_its_keys_and_is_used_again_once_writable(
        cluster: RedisClusterServers, router: ClusterRouter) -> None:
    victim, live = cluster.nodes[1], cluster.nodes[0]
    dead_key, live_key = key_on(router, victim), key_on(router, live)
    for key in (dead_key, live_key):
        assert await router.execute(key, "SET", key, b"v")
    manager = router._client.nodes_manager  # redis-py's map: must stay untouched
    epoch = manager._epoch
    live_connections = list(router.owner(live_key)._connections)

    victim.kill()
    with pytest.raises(NodeDownError):  # the command that finds it dead
        await router.execute(dead_key, "GET", dead_key)
    assert router.down == {f"{victim.host}:{victim.port}"}
    for _ in range(20):  # then at once, nothing sent; the live masters answer throughout
        with pytest.raises(NodeDownError):
            await router.execute(dead_key, "GET", dead_key)
        with pytest.raises(NodeDownError):
            await router.check([live_key, dead_key])
        with pytest.raises(NodeDownError):
            await router.execute_many([(live_key, ("GET", live_key)),
                                       (dead_key, ("GET", dead_key))])
        assert await router.execute(live_key, "GET", live_key) == b"v"
        assert await router.execute_many([(live_key, ("GET", live_key))]) == [b"v"]
    # redis-py's own routing reloaded the map, and marked every connection of every master
    # for reconnect, on each of these errors.
    assert manager._epoch == epoch
    assert all(c.is_connected and not c.should_reconnect() for c in live_connections)

    victim.start()  # same port and nodes.conf: back with its slots, empty
    await wait_for(lambda: cluster_ok(victim), "the restarted master writable")
    await wait_for(lambda: not router.down, "the router using it again")
    assert await router.execute(dead_key, "GET", dead_key) is None  # restarted empty
    assert await router.execute(dead_key, "SET", dead_key, b"w")
    assert await router.execute_many([(dead_key, ("GET", dead_key)),
                                      (live_key, ("GET", live_key))]) == [b"w", b"v"]


async def test_a_stale_slot_map_follows_moved_and_is_corrected(
        cluster: RedisClusterServers, router: ClusterRouter) -> None:
    await wait_for(lambda: all(cluster_ok(n) for n in cluster.nodes), "cluster ok")
    key = key_on(router, cluster.nodes[2])
    manager = router._client.nodes_manager
    slot = router.slot(key)
    owner = manager.slots_cache[slot][0]
    wrong = router.owner(key_on(router, cluster.nodes[0]))
    others = [s for s, nodes in manager.slots_cache.items() if nodes[0] is owner and s != slot]
    for stale in (slot, *others):  # as if all of its slots had moved since the map was read
        manager.slots_cache[stale] = [wrong]
    assert await router.execute(key, "SET", key, b"m")  # MOVED, followed
    assert await router.execute_many([(key, ("GET", key))]) == [b"m"]
    # The MOVED patched one slot; the map check it started reloads the rest.
    await wait_for(lambda: all(manager.slots_cache[s][0].name == owner.name for s in others),
                   "the map corrected")


async def test_a_caller_that_gives_up_does_not_cancel_the_map_load(
        cluster: RedisClusterServers) -> None:
    """The first requests' deadlines (50 ms by default) are shorter than loading the map on a
    busy machine; a cancelled load used to close every connection and start over."""
    client = make_client(cluster.url, 0.5)
    assert isinstance(client, RedisCluster)
    loads = []
    begun = asyncio.Event()
    load = client.initialize

    async def counted(*args: Any, **kwargs: Any) -> RedisCluster:
        loads.append(1)
        begun.set()
        return await load(*args, **kwargs)

    client.initialize = counted  # type: ignore[method-assign]
    router = ClusterRouter(client)
    try:
        waiters = [asyncio.create_task(router.ready()) for _ in range(3)]
        await begun.wait()  # all of them waiting for the load, which has begun
        for waiter in waiters:
            waiter.cancel()  # their deadlines ran out
        await asyncio.gather(*waiters, return_exceptions=True)
        assert all(waiter.cancelled() for waiter in waiters)
        await router.ready()
        key = "router-test-load"
        assert await router.execute(key, "SET", key, b"x")
        assert len(loads) == 1
    finally:
        await router.aclose()
        await client.aclose()
