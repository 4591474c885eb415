"""The gRPC service through a real grpc.aio channel (memory store): what Envoy sees."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
import grpc
import orjson
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ratelimit.descriptors import Limit
from ratelimit.limiter import DescriptorOutcome, Limiter, LimitOutcome, LimitRequest
from ratelimit.service import RateLimitProcess, RateLimitServicer, rate_limit_process
from sidecar_runtime.h2grpc import Context
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.wire import pb_write

CONFIG = """
domain: llm
descriptors:
  - key: kind
    value: requests
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 2, name: per-key}
      - key: tenant
        rate_limit: {unit: 5m, requests_per_unit: 100}
  - key: kind
    value: tokens
    descriptors:
      - key: api_key
        rate_limit: {unit: minute, requests_per_unit: 60, debt: true}
  - key: ldap
    rate_limit: {unlimited: true}
"""

Response = rls_pb2.RateLimitResponse


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RateLimitProcess]:
    path = tmp_path / "ratelimit.yaml"
    path.write_text(CONFIG)
    server = rate_limit_process(str(path), "127.0.0.1", 0, 0, Settings(reload_interval_s=0.1))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=0.5)


@pytest.fixture
async def channel(server: RateLimitProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


def descriptor(*entries: tuple[str, str], hits: int | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    out = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
    )
    if hits is not None:
        out.hits_addend.value = hits
    return out


async def ask(
    channel: grpc.aio.Channel,
    *descriptors: ratelimit_pb2.RateLimitDescriptor,
    domain: str = "llm",
    hits_addend: int = 0,
) -> rls_pb2.RateLimitResponse:
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors), hits_addend=hits_addend)
    response: rls_pb2.RateLimitResponse = await stub.ShouldRateLimit(request, timeout=5)
    return response


KEY = descriptor(("kind", "requests"), ("api_key", "k1"))


async def test_ok_statuses_carry_limit_remaining_and_reset(channel: grpc.aio.Channel) -> None:
    response = await ask(channel, KEY)
    assert response.overall_code == Response.OK
    status = response.statuses[0]
    assert status.code == Response.OK
    assert status.current_limit.requests_per_unit == 2
    assert status.current_limit.unit == Response.RateLimit.SECOND
    assert status.current_limit.name == "per-key"
    assert status.limit_remaining == 1
    assert status.duration_until_reset.seconds == 1
    assert not response.raw_body
    # OpenAI's names for the tightest requests bucket, added to the client's response by Envoy.
    assert {(h.key, h.value) for h in response.response_headers_to_add} == {
        ("x-ratelimit-limit-requests", "2"), ("x-ratelimit-remaining-requests", "1"),
        ("x-ratelimit-reset-requests", "500ms")}


async def test_over_limit_has_retry_after_and_openai_body(channel: grpc.aio.Channel) -> None:
    await ask(channel, KEY)
    await ask(channel, KEY)
    response = await ask(channel, KEY)
    assert response.overall_code == Response.OVER_LIMIT
    assert response.statuses[0].code == Response.OVER_LIMIT
    assert response.statuses[0].limit_remaining == 0
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert headers == {"retry-after": "1", "content-type": "application/json",
                       "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": headers["x-ratelimit-reset-requests"]}
    body = orjson.loads(response.raw_body)
    assert body == {
        "error": {
            "message": "Rate limit reached for requests per api_key: limit 2 per second. "
            "Please retry after 1 second.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert b"k1" not in response.raw_body


async def test_tokens_body_and_multi_unit_limit(channel: grpc.aio.Channel) -> None:
    tenant = descriptor(("kind", "requests"), ("tenant", "legal"))
    response = await ask(channel, tenant)
    assert response.statuses[0].current_limit.requests_per_unit == 20
    assert response.statuses[0].current_limit.unit == Response.RateLimit.MINUTE
    tokens = descriptor(("kind", "tokens"), ("api_key", "k1"), hits=500)
    assert (await ask(channel, tokens)).overall_code == Response.OK
    response = await ask(channel, descriptor(("kind", "tokens"), ("api_key", "k1"), hits=0))
    assert response.overall_code == Response.OVER_LIMIT
    body = orjson.loads(response.raw_body)["error"]
    assert body["type"] == "tokens"
    assert body["message"].startswith("Rate limit reached for tokens per api_key")
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert int(headers["retry-after"]) in (440, 441)


def remaining(response: rls_pb2.RateLimitResponse) -> int:
    """The bucket's true level, from OpenAI's header (the IETF status is capped at the rate)."""
    headers = {h.key: h.value for h in response.response_headers_to_add}
    return int(headers["x-ratelimit-remaining-requests"])


async def test_hits_addend_semantics(channel: grpc.aio.Channel) -> None:
    tenant = descriptor(("kind", "requests"), ("tenant", "t"))
    assert remaining(await ask(channel, tenant)) == 99  # unset: 1
    assert remaining(await ask(channel, tenant, hits_addend=9)) == 90
    check = descriptor(("kind", "requests"), ("tenant", "t"), hits=0)
    assert remaining(await ask(channel, check, hits_addend=9)) == 90
    big = descriptor(("kind", "requests"), ("tenant", "t"), hits=2**64 - 1)
    response = await ask(channel, big)
    assert response.overall_code == Response.OVER_LIMIT
    assert remaining(await ask(channel, check)) == 90


async def test_remaining_never_shows_above_the_limit(channel: grpc.aio.Channel) -> None:
    """The tenant bucket holds 100 (burst) but refills 20/min: Envoy's x-ratelimit-limit shows
    20, so x-ratelimit-remaining must not show 99 (OpenAI's headers carry the true numbers)."""
    response = await ask(channel, descriptor(("kind", "requests"), ("tenant", "burst")))
    status = response.statuses[0]
    assert status.current_limit.requests_per_unit == 20
    assert status.limit_remaining == 20
    assert remaining(response) == 99
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert headers["x-ratelimit-limit-requests"] == "100"


async def test_unknown_domain_unmatched_and_unlimited_are_ok(channel: grpc.aio.Channel) -> None:
    response = await ask(channel, KEY, domain="no-such-domain")
    assert response.overall_code == Response.OK
    assert not response.statuses[0].HasField("current_limit")
    response = await ask(channel, descriptor(("ldap", "x")), descriptor(("color", "red")))
    assert [s.code for s in response.statuses] == [Response.OK, Response.OK]
    assert response.statuses[0].limit_remaining == 2**32 - 1
    assert (await ask(channel, domain="")).overall_code == Response.OK
    assert (await ask(channel, descriptor())).overall_code == Response.OK


async def test_garbage_does_not_crash_the_service(channel: grpc.aio.Channel) -> None:
    raw = channel.unary_unary(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        request_serializer=None,
        response_deserializer=None,
    )
    for junk in (b"\xff\xfe\xfd garbage", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05\x0a\x03\xff\xfe"):
        with pytest.raises(grpc.aio.AioRpcError):
            await raw(junk, timeout=5)
    assert (await ask(channel, KEY)).overall_code == Response.OK


@pytest.mark.parametrize(("entries", "message"), [
    (2_097_000, "the request (4,194,010 bytes) exceeds the bound of 1,048,576 bytes per request"),
    (524_000, "descriptor 1 exceeds the bound of 64 entries per descriptor"),
])
async def test_a_descriptor_of_millions_of_empty_entries_is_refused_as_invalid(
        channel: grpc.aio.Channel, entries: int, message: str) -> None:
    """One descriptor of ~2.1M empty entries (just under the server's 4 MiB message) was
    answered OK after seconds of event-loop CPU; now refused on its bytes, as is its first MiB."""
    raw = channel.unary_unary(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        request_serializer=None,
        response_deserializer=None,
    )
    hostile = pb_write.string(1, "llm") + pb_write.field(2, b"\x0a\x00" * entries)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await raw(hostile, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == message
    assert (await ask(channel, KEY)).overall_code == Response.OK


class _NamelessAnswer:
    """A limiter whose answer names a limit UTF-8 cannot carry (the loader refuses such a
    name; a bug could still make one)."""

    async def check(self, request: LimitRequest) -> LimitOutcome:
        limit = Limit("k", 1, "second", name="per-\ud800")
        return LimitOutcome(False, (DescriptorOutcome("over_limit", limit, 0, 1.0, 1.0),), 1)


async def test_an_answer_that_cannot_be_written_is_logged_and_admitted() -> None:
    servicer = RateLimitServicer(cast(Limiter, _NamelessAnswer()))
    raw = rls_pb2.RateLimitRequest(domain="llm", descriptors=[KEY]).SerializeToString()
    answer = Response.FromString(await servicer.should_rate_limit(raw, cast(Context, None)))
    assert answer.overall_code == Response.OK


async def test_health_and_http_endpoints(server: RateLimitProcess, channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "envoy.service.ratelimit.v3.RateLimitService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await ask(channel, KEY)
    async with aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{server.metrics_port}"
        async with session.get(f"{base}/healthz") as reply:
            assert reply.status == 200
        async with session.get(f"{base}/metrics") as reply:
            text = await reply.text()
    assert 'ratelimit_decisions_total{kind="requests",level="api_key",result="ok"} 1.0' in text
    assert "ratelimit_breaker_state" in text
    assert "ratelimit_config_reloads_total" in text or "ratelimit_config_reloads" in text
