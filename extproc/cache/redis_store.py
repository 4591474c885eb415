"""Cached vectors in Redis (standalone or Cluster), shared by every extproc replica.

A lookup is one ``MGET``; a store is one pipeline of ``SET key value PX ttl``. On a Cluster,
through :class:`~sidecar_runtime.redis.cluster.ClusterRouter`: one ``MGET`` per slot, one pipeline
per master, masters in parallel, and a master that is down fails the call at once. Values are
the bytes of :mod:`extproc.cache.codec`, with no client-side encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from extproc.errors import BackendError, NodeDown
from sidecar_runtime.redis.client import MAX_CONNECTIONS, Client
from sidecar_runtime.redis.cluster import ClusterRouter, NodeDownError

T = TypeVar("T")


class RedisVectorStore:
    def __init__(self, client: Client) -> None:
        self._client = client
        # redis-py's cluster client raises when a node's pool is exhausted instead of waiting;
        # waiting here counts against the caller's deadline, which is what we want.
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._router = ClusterRouter(client) if isinstance(client, RedisCluster) else None

    @property
    def client(self) -> Client:
        return self._client

    async def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` once more if its connection turned out dead (Redis restarted since it was
        pooled): both commands are idempotent, the caller's deadline bounds the pair, and a
        Redis that is really down refuses the new connection at once. Without this, the
        breaker's first probe after an outage would fail on a stale connection and keep the
        cache bypassed for another cooldown. (On a Cluster the router does this per master.)"""
        try:
            async with self._slots:
                if self._router is not None:
                    return await call()
                try:
                    return await call()
                except RedisConnectionError:
                    return await call()
        except NodeDownError as exc:
            raise NodeDown(f"redis: {exc}") from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        router, client = self._router, self._client
        if router is None:
            found: list[Any] = await self._run(lambda: client.mget(list(keys)))  # bytes: no decoding
            return found
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(router.slot(key), []).append(i)
        groups = list(by_slot.values())
        commands = [(keys[g[0]], ("MGET", *(keys[i] for i in g))) for g in groups]
        replies = await self._run(lambda: router.execute_many(commands))
        values: list[bytes | None] = [None] * len(keys)
        for group, reply in zip(groups, replies, strict=True):
            for i, value in zip(group, reply, strict=True):
                values[i] = value
        return values

    async def set_many(self, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        if not entries:
            return
        ttl_ms = max(1, ttl_s * 1000)
        router = self._router

        async def store() -> None:
            if router is not None:
                await router.execute_many([(key, ("SET", key, value, "PX", ttl_ms))
                                           for key, value in entries])
                return
            pipe = self._client.pipeline(transaction=False)
            for key, value in entries:
                pipe.set(key, value, px=ttl_ms)
            await pipe.execute()

        await self._run(store)

    async def aclose(self) -> None:
        if self._router is not None:
            await self._router.aclose()
        await self._client.aclose()
