"""Cached vectors in Redis (standalone or Cluster), shared by every extproc replica.

A lookup is one ``MGET`` (on Cluster, redis-py's ``mget_nonatomic``: one ``MGET`` per slot, sent
as one pipeline, nodes in parallel); a store is one pipeline of ``SET key value PX ttl``. Values
are the bytes of :mod:`extproc.cache_codec`, with no client-side encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from extproc.errors import BackendError
from llm_sidecar.redis_client import CLUSTER_MAX_CONNECTIONS, Client

T = TypeVar("T")


class RedisVectorStore:
    def __init__(self, client: Client) -> None:
        self._client = client
        # redis-py's cluster client raises when a node's pool is exhausted instead of waiting;
        # waiting here counts against the caller's deadline, which is what we want.
        self._slots = asyncio.Semaphore(CLUSTER_MAX_CONNECTIONS)

    @property
    def client(self) -> Client:
        return self._client

    async def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` once more if its connection turned out dead (Redis restarted since it was
        pooled): both commands are idempotent, the caller's deadline bounds the pair, and a
        Redis that is really down refuses the new connection at once. Without this, the
        breaker's first probe after an outage would fail on a stale connection and keep the
        cache bypassed for another cooldown."""
        try:
            async with self._slots:
                try:
                    return await call()
                except RedisConnectionError:
                    return await call()
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        client = self._client
        if isinstance(client, RedisCluster):
            cluster = client
            values = await self._run(lambda: cluster.mget_nonatomic(list(keys)))
        else:
            values = await self._run(lambda: client.mget(list(keys)))
        return list(values)

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        if not entries:
            return
        ttl_ms = max(1, ttl_s * 1000)

        async def store() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in entries:
                pipe.set(key, value, px=ttl_ms)
            await pipe.execute()

        await self._run(store)

    async def aclose(self) -> None:
        await self._client.aclose()
