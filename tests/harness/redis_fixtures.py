"""pytest fixtures for real Redis; every one calls ``unavailable("redis")`` when it cannot
get a server (a skip on a laptop, a failure in CI).

* ``redis_server``: one standalone server per test module (external if
  ``LLM_SIDECAR_TEST_REDIS_URL`` is set), flushed before each test.
* ``own_redis_server``: a fresh local server per test that the test may ``kill()``,
  ``restart()``, ``pause()`` and ``resume()``; never the external one.
* ``redis_cluster``: three cluster masters per test module, flushed before each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.ci import unavailable
from tests.harness.redis_servers import (
    RedisClusterServers,
    RedisServer,
    RedisUnavailable,
    start_redis,
    start_redis_cluster,
)

__all__ = [
    "own_redis_server",
    "redis_cluster",
    "redis_cluster_module",
    "redis_server",
    "redis_server_module",
]


@pytest.fixture(scope="module")
def redis_server_module() -> Iterator[RedisServer | None]:
    try:
        server = start_redis()
    except RedisUnavailable:
        yield None
        return
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_server_module: RedisServer | None) -> RedisServer:
    if redis_server_module is None:
        unavailable("redis")
    redis_server_module.flush()
    return redis_server_module


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    try:
        server = start_redis(allow_external=False)
    except RedisUnavailable:
        unavailable("redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster_module() -> Iterator[RedisClusterServers | None]:
    try:
        cluster = start_redis_cluster()
    except RedisUnavailable:
        yield None
        return
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_module: RedisClusterServers | None) -> RedisClusterServers:
    if redis_cluster_module is None:
        unavailable("redis cluster")
    redis_cluster_module.flush()
    return redis_cluster_module
