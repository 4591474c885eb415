"""Redis dies or freezes under a running ratelimit service: answers keep their deadline,
``on_backend_error`` decides, the breaker skips Redis, and enforcement comes back by itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import orjson
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from pydantic import SecretStr

from ratelimit.service import RateLimitService, rate_limit_process
from ratelimit.shielded_store import ShieldedStore
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.redis.breaker import BreakerState
from tests.harness.redis_servers import RedisClusterServers, RedisServer

pytestmark = pytest.mark.redis

Response = rls_pb2.RateLimitResponse
DEADLINE_S = 0.2
"""The chaos rigs' deadline: these tests count deadlines, so a healthy Redis must never miss
one, and it sometimes misses the 50 ms default on a busy 2-core machine."""
SLACK_S = 0.5
"""What an answer may take beyond the deadline on a loaded machine: far below a hang (5 s)."""
RECOVERY_BOUND_S = 3.0
"""The service tries Redis again one breaker cooldown (1 s) after it failed; the rest is margin
for a loaded machine."""
COOLDOWN_S = Settings().redis_breaker_cooldown_ms / 1000  # the default, 1 s
REQUEST = rls_pb2.RateLimitRequest(
    domain="llm",
    descriptors=[
        ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="api_key", value="k")]
        )
    ],
)


def config(policy: str, descriptors: str = """
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 3}""") -> str:
    return f"""
domain: llm
on_backend_error: {policy}
descriptors:{descriptors}
"""


class Client:
    def __init__(self, server: RateLimitService, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.stub = rls_pb2_grpc.RateLimitServiceStub(channel)

    async def ask(self) -> tuple[rls_pb2.RateLimitResponse, float]:
        started = time.perf_counter()
        response = await self.stub.ShouldRateLimit(REQUEST, timeout=5)
        return response, time.perf_counter() - started

    def breaker(self) -> BreakerState:
        assert isinstance(self.server.store, ShieldedStore)
        return self.server.store.breaker_state

    def skipped(self) -> float:
        return float(self.server.metrics.backend_errors.labels("breaker_open")._value.get())


@pytest.fixture(params=["allow", "deny"])
async def client(
    request: pytest.FixtureRequest, own_redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[Client]:
    path = tmp_path / "ratelimit.yaml"
    path.write_text(config(request.param))
    settings = Settings(
        redis_url=SecretStr(own_redis_server.url),
        redis_timeout_ms=int(DEADLINE_S * 1000),
        redis_breaker_failures=1,  # these tests count deadlines: open on the first failure
    )
    server = rate_limit_process(str(path), "127.0.0.1", 0, 0, settings)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Client(server.service, channel)
    finally:
        await server.stop(grace_s=0.2)


def policy_of(client: Client) -> str:
    return client.server.reloader.current().domains["llm"].on_backend_error


async def test_killed_redis(client: Client, own_redis_server: RedisServer) -> None:
    allow = policy_of(client) == "allow"
    codes = [(await client.ask())[0].overall_code for _ in range(4)]
    assert codes == [Response.OK] * 3 + [Response.OVER_LIMIT]
    await asyncio.gather(*(client.ask() for _ in range(20)))  # a pool of connections to go stale

    own_redis_server.kill()
    response, took = await client.ask()
    assert took < DEADLINE_S + SLACK_S
    assert response.overall_code == (Response.OK if allow else Response.OVER_LIMIT)
    if not allow:
        error = orjson.loads(response.raw_body)["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
    assert client.breaker() is BreakerState.OPEN

    before = client.skipped()
    for _ in range(10):
        response, took = await client.ask()
        assert took < DEADLINE_S + SLACK_S
    assert client.skipped() - before >= 9  # Redis not even tried while the breaker is open

    own_redis_server.restart()  # empty: the old bucket is gone
    restarted = time.monotonic()
    while True:
        response, _ = await client.ask()
        fresh = response.overall_code == Response.OK and response.statuses[0].limit_remaining == 2
        if fresh:
            print(f"enforcement resumed {time.monotonic() - restarted:.2f} s after the restart")
            break
        assert time.monotonic() - restarted < RECOVERY_BOUND_S, "enforcement did not resume"
        await asyncio.sleep(0.05)
    assert client.breaker() is BreakerState.CLOSED
    codes = [(await client.ask())[0].overall_code for _ in range(3)]
    assert codes == [Response.OK, Response.OK, Response.OVER_LIMIT]


async def test_frozen_redis_costs_one_deadline(client: Client, own_redis_server: RedisServer) -> None:
    allow = policy_of(client) == "allow"
    assert (await client.ask())[0].overall_code == Response.OK
    own_redis_server.pause()
    try:
        response, took = await client.ask()
        assert DEADLINE_S * 0.8 < took < DEADLINE_S + SLACK_S
        assert response.overall_code == (Response.OK if allow else Response.OVER_LIMIT)
        response, took = await client.ask()
        assert took < DEADLINE_S  # the breaker answers at once
    finally:
        own_redis_server.resume()
    resumed = time.monotonic()
    while True:
        response, _ = await client.ask()
        if response.overall_code == Response.OK and response.statuses[0].limit_remaining < 3:
            break
        assert time.monotonic() - resumed < RECOVERY_BOUND_S, "enforcement did not resume"
        await asyncio.sleep(0.05)


CAPPED = """
  - key: kind
    value: requests
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 1000}
  - key: kind
    value: concurrent
    descriptors:
      - key: tenant
        rate_limit: {concurrent: 1}"""


def _entries(*pairs: tuple[str, str]) -> list[ratelimit_pb2.RateLimitDescriptor.Entry]:
    return [ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs]


def take_slot(lease: str) -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(domain="llm", descriptors=[ratelimit_pb2.RateLimitDescriptor(
        entries=_entries(("kind", "concurrent"), ("tenant", "t"), ("llm_sidecar.lease", lease)))])


PROBE = rls_pb2.RateLimitRequest(domain="llm", descriptors=[ratelimit_pb2.RateLimitDescriptor(
    entries=_entries(("kind", "requests"), ("tenant", "t")))])


@pytest.fixture(params=["standalone", "cluster"])
def freezable(request: pytest.FixtureRequest) -> RedisServer | RedisClusterServers:
    """A Redis, or a Cluster whose masters freeze and thaw together."""
    name = "own_redis_server" if request.param == "standalone" else "redis_cluster"
    server: RedisServer | RedisClusterServers = request.getfixturevalue(name)
    return server


@pytest.mark.parametrize("policy", ["allow", "deny"])
async def test_a_decision_that_missed_its_deadline_gives_its_slot_back_when_redis_returns(
        freezable: RedisServer | RedisClusterServers, tmp_path: Path, policy: str) -> None:
    """Redis frozen while a capped request is decided: the request is answered by
    ``on_backend_error``, the script runs when Redis thaws and takes the slot, and the service
    takes it back when that late reply arrives. Before, the slot stayed taken for the lease's
    10 minutes with nothing in flight: every later request of the tenant got 429. On a
    Cluster too, every master frozen for a little longer than the deadline (within the
    connection's read timeout, as a latency spike such as a fork): there redis-py would drop
    the reply of a caller that gave up with its connection."""
    path = tmp_path / "ratelimit.yaml"
    path.write_text(config(policy, CAPPED))
    # The default deadline: the freeze must outlast it and stay within the read timeout.
    settings = Settings(redis_url=SecretStr(freezable.url), redis_timeout_ms=50,
                        redis_breaker_failures=1)
    server = rate_limit_process(str(path), "127.0.0.1", 0, 0, settings)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            store = server.service.store
            assert isinstance(store, ShieldedStore)
            deadline = time.monotonic() + 10
            # Up first: a Cluster's client loads its slot map on the first call, which can
            # miss the 50 ms deadline on a loaded machine (and open the breaker).
            while (await stub.ShouldRateLimit(PROBE, timeout=5)).overall_code != Response.OK:
                assert time.monotonic() < deadline, "the store never answered"
                await asyncio.sleep(0.05)
            freezable.pause()
            try:
                await stub.ShouldRateLimit(take_slot("a" * 24), timeout=5)  # its deadline passes
            finally:
                freezable.resume()
            deadline = time.monotonic() + 10
            while store.breaker_state is not BreakerState.CLOSED:  # a probe closes it
                await stub.ShouldRateLimit(PROBE, timeout=5)
                assert time.monotonic() < deadline, "Redis did not come back"
                await asyncio.sleep(0.05)

            async def free() -> bool:
                answer = await stub.ShouldRateLimit(take_slot("b" * 24), timeout=5)
                return bool(answer.overall_code == Response.OK)
            while not await free():  # the late reply's refund may still be on its way
                assert time.monotonic() < deadline, "the late decision's slot was never freed"
                await asyncio.sleep(0.05)
            # The cap holds: the slot "b" took is the only one.
            answer = await stub.ShouldRateLimit(take_slot("c" * 24), timeout=5)
            assert answer.overall_code == Response.OVER_LIMIT
    finally:
        await server.stop(grace_s=0.2)

