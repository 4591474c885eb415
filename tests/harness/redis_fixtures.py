"""pytest fixtures for real Redis; every one calls ``unavailable("redis")`` when it cannot
get a server (a skip on a laptop, a failure in CI).

* ``redis_server``: one standalone server per test module (external if
  ``LLM_SIDECAR_TEST_REDIS_URL`` is set), flushed before each test.
* ``own_redis_server``: a fresh local server per test that the test may ``kill()``,
  ``restart()``, ``pause()`` and ``resume()``; never the external one.
* ``redis_cluster``: three cluster masters per test module, flushed before each test.

``serving(start)`` and ``process_redis(...)`` are the same "start it or be unavailable, stop
it afterwards" for fixtures that need a server of their own shape (a password, debug
commands, a cluster behind a gateway).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import pytest

from tests.harness.ci import unavailable
from tests.harness.redis_servers import (
    ProcessRedis,
    RedisClusterServers,
    RedisServer,
    RedisUnavailable,
    redis_binary,
    start_redis,
    start_redis_cluster,
)

__all__ = [
    "own_redis_server",
    "process_redis",
    "redis_cluster",
    "redis_cluster_module",
    "redis_server",
    "redis_server_module",
    "serving",
]


class _Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


@contextmanager
def serving(start: Callable[[], S], what: str = "redis") -> Iterator[S]:
    """``start()``'s server until the block ends; ``unavailable(what)`` if it cannot start."""
    try:
        server = start()
    except RedisUnavailable:
        unavailable(what)
    try:
        yield server
    finally:
        server.stop()


def _debug_args(binary: str) -> tuple[str, ...]:
    """Redis 7 refuses DEBUG unless enabled; 6 has no such option."""
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             check=False).stdout
    major = version.split("v=", 1)[1].split(".", 1)[0] if "v=" in version else "6"
    return ("--enable-debug-command", "yes") if major.isdigit() and int(major) >= 7 else ()


@contextmanager
def process_redis(password: str | None = None, debug_commands: bool = False) -> Iterator[ProcessRedis]:
    """A local ``redis-server`` child (never the external one): with ``requirepass`` when
    given a password, with ``DEBUG`` (``DEBUG SLEEP``) allowed when asked."""
    binary = redis_binary()
    if binary is None:
        unavailable("redis")
    extra = _debug_args(binary) if debug_commands else ()
    with serving(lambda: ProcessRedis(binary=binary, password=password, extra_args=extra).start()) as server:
        yield server


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
    with serving(lambda: start_redis(allow_external=False)) as server:
        yield server


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
