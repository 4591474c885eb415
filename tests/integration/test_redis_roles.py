"""The deployment's two Redis roles when memory is full, on a real Redis configured as
deploy/ configures it (``maxmemory`` made small so it fills in a moment): the buckets Redis
refuses writes and evicts nothing, the cache Redis evicts old vectors and keeps accepting."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from extproc.cache.redis_store import RedisVectorStore
from ratelimit.bucket import BucketSpec, Hit
from ratelimit.errors import BackendError
from ratelimit.keys import bucket_key
from ratelimit.redis_store import RedisStore
from routing.render.deploy import REDIS_BUCKETS, REDIS_CACHE, RedisRole
from sidecar_runtime.redis.client import make_client
from tests.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis

SLOW = 1e-4  # tokens per second: nothing refills during a test
ROOM = 1024 * 1024


def configure(server: RedisServer, role: RedisRole) -> redis.Redis:
    """The role's eviction policy, and a ``maxmemory`` 1 MiB above what Redis uses now."""
    client = server.client()
    args = role.args("unused")
    client.config_set("maxmemory-policy", args[args.index("--maxmemory-policy") + 1])
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + ROOM)
    return client


def overfill(client: redis.Redis) -> None:
    """Put Redis past its ``maxmemory`` for good: 2 MiB of values with a TTL (as every key
    of both roles has), then a limit 1 MiB under what it uses. With ``noeviction`` nothing
    makes room, so every write is refused from here on."""
    client.config_set("maxmemory", 0)  # no limit while filling
    for n in range(32):
        client.set(f"filler:{n}", b"x" * 65536, px=600_000)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - ROOM)


@pytest.fixture
async def buckets(own_redis_server: RedisServer) -> AsyncIterator[tuple[RedisStore, redis.Redis]]:
    client = configure(own_redis_server, REDIS_BUCKETS)
    store = RedisStore(make_client(own_redis_server.url, 2.0), margin_s=0.05)
    try:
        yield store, client
    finally:
        await store.aclose()
        client.close()


async def test_a_full_buckets_redis_evicts_no_bucket_and_fails_decisions(
        buckets: tuple[RedisStore, redis.Redis]) -> None:
    store, client = buckets
    key = bucket_key("roles", [("api_key", "drained")])
    spec = BucketSpec(1, SLOW)
    assert (await store.decide([Hit(key, spec, 1)])).admitted
    assert not (await store.decide([Hit(key, spec, 1)])).admitted  # drained
    overfill(client)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", b"x")
    # full: nothing was evicted, the drained bucket least of all (an evicted bucket comes back
    # full), and it still denies (a denial writes nothing, so Redis runs it) ...
    assert client.exists(key, "filler:0", "filler:31") == 3
    assert not (await store.decide([Hit(key, spec, 1)])).admitted
    # ... while an admission, which writes, is a Redis error: ratelimit answers it with
    # on_backend_error, as for a Redis that is down
    with pytest.raises(BackendError, match="OOM"):
        await store.decide([Hit(bucket_key("roles", [("api_key", "new")]), spec, 1)])

async def test_a_full_cache_redis_evicts_the_oldest_vectors_and_keeps_storing(
        own_redis_server: RedisServer) -> None:
    client = configure(own_redis_server, REDIS_CACHE)
    store = RedisVectorStore(make_client(own_redis_server.url, 2.0))
    try:
        keys = [f"emb:roles:{n}" for n in range(64)]
        for key in keys:  # 4 MiB of vectors into 1 MiB of room: no write fails
            await store.set_many([(key, b"v" * 65536)], ttl_s=7 * 86400)
        found = await store.get_many(keys)
        evicted = int(client.info("stats")["evicted_keys"])
    finally:
        await store.aclose()
        client.close()
    assert evicted > 0
    # Redis's LRU is approximate (it evicts the idlest of a few sampled keys), so which key goes
    # is not fixed: key 0 itself sometimes outlives most of the rest. In 40 runs 14 keys
    # survived, of them 0, 1, 2 or 3 from the older half 18, 14, 5 and 3 times (Poisson-like,
    # mean 0.8: 7 or more about once in 50,000 runs). What holds: every write was taken, the
    # room came from the old writes, the newest stays. (The role's policy is the one
    # ``configure`` set from the rendered role.)
    survivors = [n for n, value in enumerate(found) if value is not None]
    old = [n for n in survivors if n < len(keys) // 2]
    assert len(old) <= 6 < len(survivors) - len(old), survivors  # the old ones made room
    assert found[-1] == b"v" * 65536  # the last one is there
