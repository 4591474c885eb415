"""One batch of settlements from extproc lands on real Redis buckets exactly as one stream-done
call per request does (issue 16): the same refunds and overage, each lease settled once, the
service's cap on descriptors per call."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from extproc.actions import Settlement
from extproc.adapters import rls_pb
from extproc.adapters.rls_client import RateLimitClient
from extproc.admission import new_lease
from extproc.settlements import settlement_for
from ratelimit.keys import bucket_key
from ratelimit.request_bounds import MAX_DESCRIPTORS
from ratelimit.service import RateLimitProcess, rate_limit_process
from routing.loader import load_config
from routing.ratelimits import DOMAIN
from routing.schema import ServicesSection
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.wire.names import LEASE_ENTRY
from tests.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis

CAPACITY = 50_000
RATE = CAPACITY / 86400  # tokens/s: a settle is visible to the token
N = 40
YAML = f"""
version: 1
clusters: {{pool: {{endpoints: ["127.0.0.1:9"], max_context: 4096}}}}
models: {{m: {{clusters: [pool]}}}}
rate_limits:
  tenant: {{default: {{tokens: {CAPACITY}/d}}}}
  model: {{default: {{tokens: {CAPACITY}/d}}}}
"""


@pytest.fixture
async def served(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[tuple[RateLimitProcess, str]]:
    path = tmp_path / "routing.yaml"
    path.write_text(YAML)
    server = rate_limit_process(str(path), "127.0.0.1", 0, 0,
                             Settings(redis_url=SecretStr(redis_server.url), redis_timeout_ms=2000))
    await server.start()
    try:
        yield server, str(path)
    finally:
        await server.stop(grace_s=0.5)


def route(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("x-llm-tenant", tenant), ("x-llm-model", f"model-of-{tenant}"))


def admission(tenant: str, lease: str, reserved: int) -> rls_pb2.RateLimitRequest:
    """What Envoy sends at admission: one token descriptor per level, the reservation as its
    hits_addend, the lease as a control entry."""
    descriptors = []
    for level, value in (("tenant", tenant), ("model", f"model-of-{tenant}")):
        d = ratelimit_pb2.RateLimitDescriptor(entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v)
            for k, v in (("kind", "tokens"), (level, value), (LEASE_ENTRY, lease))])
        d.hits_addend.value = reserved
        descriptors.append(d)
    return rls_pb2.RateLimitRequest(domain=DOMAIN, descriptors=descriptors)


def settle_request(descriptors: tuple[tuple[tuple[str, str], ...], ...]) -> rls_pb2.RateLimitRequest:
    """A stream-done call as Envoy sends it: the very bytes extproc's batches carry."""
    return rls_pb2.RateLimitRequest.FromString(rls_pb.settle_payload(descriptors))


async def levels(server: RateLimitProcess, tenant: str) -> list[float]:
    client = server.service.store.inner.client  # type: ignore[attr-defined]
    out = []
    for level, value in (("tenant", tenant), ("model", f"model-of-{tenant}")):
        raw = await client.hget(bucket_key(DOMAIN, (("kind", "tokens"), (level, value))), "l")
        out.append(float(raw))
    return out


async def test_one_batch_settles_like_one_call_per_request(served: tuple[RateLimitProcess, str]) -> None:
    server, path = served
    config = load_config(path)
    stub_channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = rls_pb2_grpc.RateLimitServiceStub(stub_channel)
    started = time.monotonic()
    # Refunds (used < reserved) and overage (used > reserved) mixed, on two tenants alike.
    plan = [(100 + 7 * i, 40 + 13 * i) for i in range(N)]
    settlements: dict[str, list[Settlement]] = {"single": [], "batched": []}
    for reserved, used in plan:
        for tenant in settlements:
            lease = new_lease()
            answer = await stub.ShouldRateLimit(admission(tenant, lease, reserved), timeout=5)
            assert answer.overall_code == rls_pb2.RateLimitResponse.OK
            settlement = settlement_for(config, route(tenant), lease, used)
            assert settlement is not None
            settlements[tenant].append(settlement)
    for settlement in settlements["single"]:  # Envoy's way: one stream-done call each
        await stub.ShouldRateLimit(settle_request(settlement.descriptors), timeout=5)
    client = RateLimitClient(CollectorRegistry())
    services = ServicesSection(ratelimit=f"127.0.0.1:{server.port}", ratelimit_timeout_s=5)
    batch = tuple(d for s in settlements["batched"] for d in s.descriptors)
    assert len(batch) == 2 * N
    assert await client.settle(services, batch)  # extproc's way: one call for all of them
    refill = (time.monotonic() - started) * RATE + 1
    expected = CAPACITY - sum(used for _, used in plan)
    single, batched = await levels(server, "single"), await levels(server, "batched")
    for level in single + batched:
        assert expected <= level <= expected + refill, (single, batched, expected)
    # Settled once: the same batch again changes nothing (beyond refill).
    assert await client.settle(services, batch)
    again = await levels(server, "batched")
    assert all(abs(a - b) <= refill for a, b in zip(again, batched, strict=True))
    redis = server.service.store.inner.client  # type: ignore[attr-defined]
    assert [key async for key in redis.scan_iter(match="*:lease:*")] == []
    await client.aclose()
    await stub_channel.close()


async def test_a_call_above_the_cap_is_refused_and_settles_nothing(
        served: tuple[RateLimitProcess, str]) -> None:
    server, path = served
    config = load_config(path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        lease = new_lease()
        await stub.ShouldRateLimit(admission("capped", lease, 1000), timeout=5)
        before = await levels(server, "capped")
        settlement = settlement_for(config, route("capped"), lease, 0)
        assert settlement is not None
        filler = settlement.descriptors[0]
        too_many = settle_request(settlement.descriptors
                                  + (filler,) * (MAX_DESCRIPTORS - 1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ShouldRateLimit(too_many, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await levels(server, "capped") == before  # the reservation stands
        at_cap = settle_request(settlement.descriptors
                                + (filler,) * (MAX_DESCRIPTORS - 2))
        answer = await stub.ShouldRateLimit(at_cap, timeout=5)
        assert answer.overall_code == rls_pb2.RateLimitResponse.OK
        after = await levels(server, "capped")
        assert all(a >= b + 999 for a, b in zip(after, before, strict=True))  # refunded


async def test_a_reload_that_moves_the_service_moves_the_batches(tmp_path: Path) -> None:
    """The batcher's call reads ``services`` at each flush: after a reload names another
    ratelimit address, the next batch goes there (memory stores: which one settled shows)."""
    path = tmp_path / "routing.yaml"
    path.write_text(YAML)
    config = load_config(str(path))
    servers = [rate_limit_process(str(path), "127.0.0.1", 0, 0, Settings()) for _ in range(2)]
    for server in servers:
        await server.start()
    client = RateLimitClient(CollectorRegistry())
    try:
        for server in servers:
            settlement = settlement_for(config, route("moved"), new_lease(), 3)
            assert settlement is not None
            services = ServicesSection(ratelimit=f"127.0.0.1:{server.port}", ratelimit_timeout_s=5)
            assert await client.settle(services, settlement.descriptors)
        assert [s.service.metrics.settlements.labels("tokens")._value.get() for s in servers] == [2, 2]
        await servers[0].stop(grace_s=0.1)
        old = ServicesSection(ratelimit=f"127.0.0.1:{servers[0].port}", ratelimit_timeout_s=1)
        assert settlement is not None
        assert not await client.settle(old, settlement.descriptors)  # gone: not answered
    finally:
        await client.aclose()
        await servers[1].stop(grace_s=0.1)
