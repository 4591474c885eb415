"""``response_to_proto``: the statuses and OpenAI headers Envoy passes on, per outcome."""

from __future__ import annotations

from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit.descriptors import Limit
from ratelimit.limiter import UNLIMITED_REMAINING, DescriptorOutcome, LimitOutcome
from ratelimit.rls_pb import openai_headers, response_to_proto

Response = rls_pb2.RateLimitResponse
PER_SECOND = Limit("a", 10, "second", name="per-second")
BURSTY = Limit("b", 100, "minute", burst=300)
UNLIMITED = Limit("c", 1, "second", unlimited=True)


def status(limit: Limit | None, remaining: int | None, kind: str = "requests",
           reset_s: float | None = 1.5, level: str = "api_key") -> DescriptorOutcome:
    return DescriptorOutcome("ok", limit, remaining, reset_s, 0.0, level, kind)


def test_the_tightest_bucket_of_each_kind_names_the_headers_and_the_first_of_equals_wins() -> None:
    statuses = (
        status(BURSTY, 250, "tokens", reset_s=30.0),
        status(PER_SECOND, 4, level="api_key", reset_s=0.6),
        status(PER_SECOND, 4, level="tenant", reset_s=9.0),  # as tight, later: not shown
        status(BURSTY, 250, "tokens", reset_s=90.0, level="model"),
        status(PER_SECOND, 0, "concurrent"),  # no OpenAI header for concurrency
        status(UNLIMITED, UNLIMITED_REMAINING),
        status(None, None),
    )
    assert openai_headers(statuses) == [
        ("x-ratelimit-limit-requests", "10"), ("x-ratelimit-remaining-requests", "4"),
        ("x-ratelimit-reset-requests", "600ms"),
        ("x-ratelimit-limit-tokens", "300"), ("x-ratelimit-remaining-tokens", "250"),
        ("x-ratelimit-reset-tokens", "30s")]


def test_no_decided_bucket_no_headers() -> None:
    assert openai_headers((status(UNLIMITED, UNLIMITED_REMAINING), status(None, None))) == []


def test_every_status_says_its_code_and_remaining_never_shows_above_the_limit() -> None:
    denied = DescriptorOutcome("over_limit", PER_SECOND, 0, 2.0, 0.1, "api_key", "requests",
                               "over_limit")
    response = response_to_proto(LimitOutcome(False, (
        status(BURSTY, 250), denied, status(None, None)), 1, denied))
    assert [s.code for s in response.statuses] == [Response.OK, Response.OVER_LIMIT, Response.OK]
    assert response.statuses[0].limit_remaining == 100  # burst 300, shown limit 100 per minute
    assert response.statuses[1].current_limit.name == "per-second"
    assert not response.statuses[2].HasField("current_limit")
    headers = [(h.key, h.value) for h in response.response_headers_to_add]
    assert headers[-2:] == [("retry-after", "1"), ("content-type", "application/json")]
    assert response.raw_body.startswith(b'{"error"')
