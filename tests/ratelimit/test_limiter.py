"""Our extensions and the request semantics, decided on a memory store and a fake clock."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from ratelimit.bucket import BucketResult, Settle
from ratelimit.errors import BackendError
from ratelimit.keys import bucket_key
from ratelimit.limiter import (
    DescriptorRequest,
    LimitRequest,
    Override,
    fallback,
    plan,
    resolve,
)
from ratelimit.loader import load_text
from ratelimit.memory_store import MemoryStore
from ratelimit.store import StoreResult

from .helpers import Decider

LLM = """
domain: llm
on_backend_error: deny
descriptors:
  - key: kind
    value: requests
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
      - key: tenant
        rate_limit: {unit: 5m, requests_per_unit: 100}
      - key: model
        value: llama-2-13b
        rate_limit: {unit: minute, unit_multiplier: 2, requests_per_unit: 6}
  - key: kind
    value: tokens
    descriptors:
      - key: api_key
        rate_limit: {unit: minute, requests_per_unit: 600, debt: true}
  - key: path
    value: /v1/embed*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: path
    value: /v1/embeddings/special
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: path
    rate_limit: {unit: second, requests_per_unit: 3}
"""

KEY = ("api_key", "k1")
REQ = ("kind", "requests")
TOK = ("kind", "tokens")


@pytest.fixture
def d() -> Decider:
    return Decider(load_text(LLM, "llm.yaml"))


async def test_burst_is_capacity_and_refill_is_the_rate(d: Decider) -> None:
    assert await d.admitted("llm", [REQ, KEY], times=25) == 20
    d.clock.advance(0.5)
    assert await d.admitted("llm", [REQ, KEY], times=10) == 5


async def test_multi_unit_windows(d: Decider) -> None:
    tenant = [REQ, ("tenant", "legal")]
    assert await d.admitted("llm", tenant, times=101) == 100
    d.clock.advance(30)  # 100 per 300 s: 10 back after 30 s
    assert await d.admitted("llm", tenant, times=11) == 10
    model = [REQ, ("model", "llama-2-13b")]
    assert await d.admitted("llm", model, times=7) == 6
    d.clock.advance(20)  # 6 per 120 s: one back after 20 s
    assert await d.admitted("llm", model, times=2) == 1


async def test_request_hits_addend_zero_means_one(d: Decider) -> None:
    outcome = await d.check("llm", [REQ, KEY], hits_addend=0)
    assert outcome.statuses[0].remaining == 19
    outcome = await d.check("llm", [REQ, KEY], hits_addend=5)
    assert outcome.statuses[0].remaining == 14


async def test_descriptor_hits_zero_is_check_only(d: Decider) -> None:
    for _ in range(3):
        outcome = await d.check("llm", [REQ, KEY], hits=0, hits_addend=7)
        assert outcome.ok and outcome.statuses[0].remaining == 20
    await d.check("llm", [REQ, KEY], hits=20)
    outcome = await d.check("llm", [REQ, KEY], hits=0)
    assert not outcome.ok  # empty: one more request would not pass


async def test_tokens_check_then_charge_into_debt(d: Decider) -> None:
    tokens = [TOK, KEY]
    assert (await d.check("llm", tokens, hits=0)).ok
    charge = await d.check("llm", tokens, hits=1500)  # usage after the response
    assert charge.ok
    assert charge.statuses[0].remaining == 0
    denied = await d.check("llm", tokens, hits=0)
    assert not denied.ok
    assert denied.cause is not None and denied.cause.kind == "tokens"
    assert denied.retry_after_s == 90  # 900 tokens of debt at 10 tokens/s
    d.clock.advance(90.5)
    assert (await d.check("llm", tokens, hits=0)).ok


async def test_wildcard_between_exact_and_default(d: Decider) -> None:
    assert await d.admitted("llm", [("path", "/v1/embeddings/special")], times=3) == 1
    assert await d.admitted("llm", [("path", "/v1/embeddings")], times=3) == 2
    assert await d.admitted("llm", [("path", "/v1/chat")], times=4) == 3


async def test_denied_request_leaves_other_buckets(d: Decider) -> None:
    tenant = [REQ, ("tenant", "t")]
    model = [REQ, ("model", "llama-2-13b")]
    assert await d.admitted("llm", model, times=6) == 6
    outcome = await d.check("llm", tenant, model)
    assert not outcome.ok
    assert [s.code for s in outcome.statuses] == ["ok", "over_limit"]
    assert outcome.statuses[0].remaining == 100  # nothing was taken from the tenant
    assert outcome.cause is not None and outcome.cause.level == "model"
    assert outcome.retry_after_s == 20


async def test_unknown_domain_and_unmatched_descriptors_are_ok(d: Decider) -> None:
    seen: list[str] = []
    d.limiter._on_unknown_domain = seen.append
    outcome = await d.check("nope", [REQ, KEY])
    assert outcome.ok and outcome.statuses[0].limit is None
    assert seen == ["nope"]
    outcome = await d.check("llm", [("color", "blue")])
    assert outcome.ok and outcome.statuses[0].limit is None
    assert len(d.store) == 0


async def test_envoy_limit_override(d: Decider) -> None:
    request = LimitRequest("llm", (DescriptorRequest((("anything", "x"),), None, Override(2, "minute")),))
    results = [(await d.limiter.check(request)).ok for _ in range(3)]
    assert results == [True, True, False]


def test_fallback_policies() -> None:
    config = load_text(LLM, "llm.yaml")
    planned = plan(config, LimitRequest("llm", (DescriptorRequest((REQ, KEY)),)))
    allow = fallback(planned, "allow")
    assert allow.ok and allow.backend_failed
    assert [s.result for s in allow.statuses] == ["backend_allow"]
    deny = fallback(planned, "deny")
    assert not deny.ok and deny.retry_after_s == 1
    assert [s.result for s in deny.statuses] == ["backend_deny"]


def test_resolve_picks_the_longest_wait_as_cause() -> None:
    config = load_text(LLM, "llm.yaml")
    request = LimitRequest("llm", (DescriptorRequest((REQ, KEY)), DescriptorRequest((REQ, ("tenant", "t")))))
    planned = plan(config, request)
    stored = StoreResult(False, (BucketResult(False, 0.5), BucketResult(False, 0.0)))
    outcome = resolve(planned, stored)
    assert outcome.retry_after_s == 3  # tenant: 1 token at 1/3 per s
    assert outcome.cause is not None and outcome.cause.level == "tenant"


def test_bucket_keys_never_hold_values() -> None:
    secret = "sk-live-THIS-IS-A-SECRET"
    key = bucket_key("llm", [("kind", "requests"), ("api_key", secret)])
    assert secret not in key
    assert key.startswith("rl:llm:kind.api_key:{") and key.endswith("}")
    assert key != bucket_key("llm", [("kind", "requests"), ("api_key", secret + "x")])
    # Length-prefixed: moving a boundary between key and value gives another bucket.
    assert bucket_key("d", [("ab", "c")]) != bucket_key("d", [("a", "bc")])
    weird = bucket_key("dom ain/{x}" * 10, [("k\n", "v")])
    assert len(weird) < 150 and "\n" not in weird and weird.count("{") == 1


SETTLING = """
domain: s
descriptors:
  - key: kind
    value: tokens
    descriptors:
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 600}
  - key: kind
    value: concurrent
    descriptors:
      - key: tenant
        rate_limit: {concurrent: 4}
"""


def _settled(d: Decider) -> dict[str, float]:
    return {sample.labels["what"]: sample.value for metric in d.metrics.settlements.collect()
            for sample in metric.samples if sample.name.endswith("_total")}


def _ending(lease: str, *, release: bool) -> DescriptorRequest:
    entries = (("kind", "concurrent" if release else "tokens"), ("tenant", "t"))
    if release:
        return DescriptorRequest(entries, lease=lease, phase="release")
    return DescriptorRequest(entries, lease=lease, phase="settle", used=5)


async def test_settlements_are_counted_per_kind_and_a_kind_never_seen_has_no_series() -> None:
    d = Decider(load_text(SETTLING, "s.yaml"))
    await d.limiter.check(LimitRequest("s", tuple(_ending(f"lease-{n:04d}", release=False)
                                                  for n in range(5))))
    assert _settled(d) == {"tokens": 5.0}  # no release series until a release comes
    await d.limiter.check(LimitRequest("s", (
        _ending("lease-0005", release=True), _ending("lease-0006", release=False),
        _ending("lease-0007", release=True), DescriptorRequest((("kind", "tokens"),)))))
    assert _settled(d) == {"tokens": 6.0, "release": 2.0}


async def test_settlements_a_failed_store_could_not_apply_are_counted_as_such() -> None:
    class Failing(MemoryStore):
        async def settle(self, settles: Sequence[Settle]) -> None:
            raise BackendError("down")

    d = Decider(load_text(SETTLING, "s.yaml"))
    d.limiter.store = Failing()
    await d.limiter.check(LimitRequest("s", (_ending("lease-0001", release=True),
                                             _ending("lease-0002", release=False))))
    assert _settled(d) == {"backend_error": 2.0}


NO_CAP = SETTLING[:SETTLING.index("  - key: kind\n    value: concurrent")]
"""SETTLING without its concurrency cap."""


async def test_a_slot_is_freed_after_a_reload_removed_its_cap() -> None:
    """Taken under ``concurrent: 4``, released after a reload took the cap away: freed all the
    same, so it does not count again when the cap comes back (it used to wait out its
    10-minute lease)."""
    d = Decider(load_text(SETTLING, "s.yaml"))
    entries = (("kind", "concurrent"), ("tenant", "t"))

    async def admit(*leases: int) -> bool:
        outcome = await d.limiter.check(LimitRequest("s", tuple(
            DescriptorRequest(entries, lease=f"lease-{n:04d}") for n in leases)))
        return outcome.ok

    assert await admit(1)
    d.config = load_text(NO_CAP, "s.yaml")  # a reload removes the cap
    await d.limiter.check(LimitRequest("s", (_ending("lease-0001", release=True),)))
    d.config = load_text(SETTLING, "s.yaml")  # and brings it back
    assert await admit(2, 3, 4, 5)  # all four slots are free
    assert not await admit(6)
