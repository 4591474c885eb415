"""The one place a Redis client is made from a URL, for every service that uses Redis.

Only store modules (the rate limiter's bucket store, extproc's vector store) and this module
import ``redis``.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

Client = Redis | RedisCluster
CLUSTER_MAX_CONNECTIONS = 128
"""Per cluster node. redis-py's cluster client raises instead of waiting when a node's pool
is exhausted, so a store never has more commands in flight than this (see its semaphore)."""


def make_client(url: str, timeout_s: float) -> Client:
    """A client for ``redis://``, ``rediss://``, ``redis+cluster://`` or ``rediss+cluster://``.

    No client-side retries: a retry would spend the caller's deadline twice (and a rate-limit
    script whose reply was lost must not run twice).
    """
    socket_timeout = max(timeout_s, 0.25)
    if "+cluster://" in url:
        return RedisCluster.from_url(
            url.replace("+cluster://", "://", 1),
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            max_connections=CLUSTER_MAX_CONNECTIONS,
        )
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
    )
