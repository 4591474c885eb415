"""The one place a Redis client is made from a URL, for every service that uses Redis.

Only store modules (the rate limiter's bucket store, extproc's vector store) and the runtime's
``redis_*`` modules import ``redis``. On a standalone Redis the rate limiter sends its commands
on connections of its own (:mod:`sidecar_runtime.redis.batch`), made from the client this module
returns: the same URL, credentials and shared TLS context.

TLS: ``rediss://`` (or ``rediss+cluster://``) verifies the server against the system CAs, or
against ``?ssl_ca_certs=/path/ca.pem``; a client certificate is ``&ssl_certfile=...&ssl_keyfile=...``
(redis-py's own URL parameters). AUTH: ``rediss://:PASSWORD@host`` or ``rediss://USER:PASSWORD@host``
(Redis 6 ACL users).
"""

from __future__ import annotations

import re
import ssl
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sidecar_runtime.redis.url import UNPARSED, RedisUrlError, check_url

Client = Redis | RedisCluster
MAX_CONNECTIONS = 128
"""Per server (per node of a Cluster). redis-py raises instead of waiting when a pool is
exhausted (8.x: a standalone pool holds 100 by default), so a store never has more commands
in flight than this (see its semaphore)."""


def _shared_context_connection() -> type[SSLConnection]:
    """An ``SSLConnection`` whose TLS context is made once per client, not once per connection.

    redis-py builds a context for every new connection, and ``ssl.create_default_context()``
    loads the system CA store: about 40 ms of CPU that blocks the event loop, on every
    connection the pool opens. That is most of a 50 ms Redis deadline, so under load new TLS
    connections missed it, were cancelled half-made, and the next request started over.
    """
    shared: list[ssl.SSLContext] = []

    class SharedContextSSLConnection(SSLConnection):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            if not shared:
                shared.append(self.ssl_context.get())
            self.ssl_context.context = shared[0]

    return SharedContextSSLConnection


def _share_tls_context(client: Client) -> None:
    """Install :func:`_shared_context_connection` on a TLS client and build its context now,
    at start-up, rather than inside the first request's deadline."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
        if kwargs.get("connection_class") is not SSLConnection:
            return
        cls = _shared_context_connection()
        kwargs["connection_class"] = cls
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = cls
            cls(**node.connection_kwargs)  # the first one builds the shared context
        return
    pool = client.connection_pool
    if pool.connection_class is SSLConnection:
        pool.connection_class = _shared_context_connection()
        pool.connection_class(**pool.connection_kwargs)


def make_client(url: str, timeout_s: float) -> Client:
    """A client for ``redis://``, ``rediss://``, ``redis+cluster://`` or ``rediss+cluster://``.

    No client-side retries: a retry would spend the caller's deadline twice (and a rate-limit
    script whose reply was lost must not run twice).
    """
    check_url(url)
    try:
        return _make_client(url, timeout_s)
    except ValueError as exc:  # redis-py's parse of the URL and its parameters
        raise RedisUrlError(_parameter_problem(exc)) from None


_BAD_PARAMETER = re.compile(r"Invalid value for '([a-z_]+)' in connection URL\.")


def _parameter_problem(exc: ValueError) -> str:
    """redis-py's complaint about a URL, as far as it names no part of the URL: the name of a
    parameter it refused, else :data:`UNPARSED`."""
    bad = _BAD_PARAMETER.fullmatch(str(exc))
    return f"Redis URL parameter {bad.group(1)}: not a value it takes" if bad else UNPARSED


def _make_client(url: str, timeout_s: float) -> Client:
    socket_timeout = max(timeout_s, 0.25)
    client: Client
    if "+cluster://" in url:
        client = RedisCluster.from_url(
            url.replace("+cluster://", "://", 1),
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            max_connections=MAX_CONNECTIONS,
        )
    else:
        client = Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            max_connections=MAX_CONNECTIONS,
        )
    _share_tls_context(client)
    return client
