"""Cached vectors in Redis (standalone or Cluster), shared by every extproc replica.

A lookup is one ``MGET`` (on Cluster, redis-py's ``mget_nonatomic``: one ``MGET`` per slot, sent
as one pipeline, nodes in parallel); a store is one pipeline of ``SET key value PX ttl``. Values
are the bytes of :mod:`extproc.cache_codec`, with no client-side encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from extproc.errors import BackendError
from llm_sidecar.redis_client import CLUSTER_MAX_CONNECTIONS, Client


class RedisVectorStore:
    def __init__(self, client: Client) -> None:
        self._client = client
        # redis-py's cluster client raises when a node's pool is exhausted instead of waiting;
        # waiting here counts against the caller's deadline, which is what we want.
        self._slots = asyncio.Semaphore(CLUSTER_MAX_CONNECTIONS)

    @property
    def client(self) -> Client:
        return self._client

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            async with self._slots:
                if isinstance(self._client, RedisCluster):
                    values = await self._client.mget_nonatomic(list(keys))
                else:
                    values = await self._client.mget(list(keys))
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc
        return list(values)

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        if not entries:
            return
        ttl_ms = max(1, ttl_s * 1000)
        try:
            async with self._slots:
                pipe = self._client.pipeline(transaction=False)
                for key, value in entries:
                    pipe.set(key, value, px=ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.aclose()
