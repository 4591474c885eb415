"""Cache hits are requests: the rate-limit check extproc makes itself, and embeddings reservations."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from extproc.actions import Continue, LimitStatus, Lookup, RateCheck, Reply, Verdict
from extproc.adapters import rls_pb
from extproc.cache.codec import encode_vector
from extproc.hit_limits import (
    answer,
    request_descriptors,
    x_ratelimit_headers,
)
from extproc.records import outcome
from extproc.stream import StreamState
from extproc.tokens import counter_for
from ratelimit.descriptors import Limit
from ratelimit.limiter import DescriptorOutcome, LimitOutcome
from ratelimit.rls_pb import response_to_proto
from routing.compiled import listed_key_id
from sidecar_runtime.wire.names import RESERVATION_METADATA_KEY
from simulator.embeddings import embed
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

SECRET = b"test-secret"
CACHED = {"kind": "embedding", "clusters": ["embed"], "cache": {"namespace": "bge", "ttl": "1h"}}
KEY = "sk-hit-limits-0123456789"
KEY_ID = listed_key_id(hashlib.sha256(KEY.encode()).hexdigest())
API_KEYS = [{"name": "bot", "tenant": "acme", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]
ROUTED = {"x-llm-key-id": KEY_ID, "x-llm-tenant": "acme", "x-llm-model": "bge-m3"}


def snap(rate_limits: dict[str, Any] | None = None, **services: Any) -> Any:
    sections: dict[str, Any] = {"models": {"bge-m3": CACHED}, "api_keys": API_KEYS}
    if rate_limits is not None:
        sections["rate_limits"] = rate_limits
    if services:
        sections["services"] = services
    return snapshot(**sections)


@pytest.mark.parametrize(("limits", "expected"), [
    (None, ()),
    ({"tenant": {"default": {"tokens": "1k/min"}}}, ()),  # a hit costs no tokens
    ({"api_key": {"default": {"requests": "10/s", "burst": 20}}},
     ((("kind", "requests"), ("api_key", KEY_ID)),)),
    ({"api_key": {"default": {"requests": "10/s", "tokens": "1k/min"}},
      "tenant": {"overrides": {"acme": {"requests": "5/min"}}},
      "model": {"overrides": {"bge-m3": {"tokens": "1M/min"}}}},
     ((("kind", "requests"), ("api_key", KEY_ID)), (("kind", "requests"), ("tenant", "acme")))),
])
def test_a_hit_is_checked_against_the_request_descriptors_envoy_would_send(
        limits: dict[str, Any] | None, expected: tuple[Any, ...]) -> None:
    assert request_descriptors(snap(limits).config, ROUTED) == expected


def test_a_descriptor_whose_header_is_absent_is_not_sent_as_in_envoy() -> None:
    config = snap({"tenant": {"default": {"requests": "1/s"}},
                   "model": {"default": {"requests": "1/s"}}}).config
    assert request_descriptors(config, {"x-llm-tenant": "t"}) == (
        (("kind", "requests"), ("tenant", "t")),)


def test_x_ratelimit_headers_name_the_tightest_limit_and_every_policy() -> None:
    statuses = (LimitStatus(10, 1, "api_key:default:requests", 7, 1),
                LimitStatus(600, 60, "tenant:acme:requests", 3, 42),
                LimitStatus(5, 0, "", 9, 3))
    assert dict(x_ratelimit_headers(statuses)) == {
        "x-ratelimit-limit": '600, 10;w=1;name="api_key:default:requests", '
                             '600;w=60;name="tenant:acme:requests"',
        "x-ratelimit-remaining": "3",
        "x-ratelimit-reset": "42",
    }
    assert x_ratelimit_headers(()) == ()


HIT = Reply(200, b"{}", (("content-type", "application/json"), ("x-llm-cache", "hit")))


@pytest.mark.parametrize(("verdict", "deny", "status"), [
    (Verdict("ok"), False, 200),
    (Verdict("unavailable"), False, 200),   # fail open, as Envoy's filter by default
    (Verdict("unavailable"), True, 503),    # services.ratelimit_failure_mode_deny
    (Verdict("over_limit", b'{"error": 1}', (("retry-after", "3"),)), False, 429),
    (Verdict("over_limit", b'{"error": 1}', (("retry-after", "3"),)), True, 429),
])
def test_the_answer_follows_the_verdict_and_the_failure_policy(
        verdict: Verdict, deny: bool, status: int) -> None:
    reply = answer(verdict, HIT, deny)
    assert reply.status == status
    if status == 503:
        error = orjson.loads(reply.body)["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
    if status == 429:
        assert reply.body == b'{"error": 1}' and dict(reply.headers)["retry-after"] == "3"
        assert "x-llm-cache" not in dict(reply.headers)  # a refused hit serves nothing


def test_a_denial_the_rate_limiters_store_caused_is_a_503_as_envoy_maps_it() -> None:
    denied = LimitOutcome(False, (), 1, backend_failed=True)
    verdict = rls_pb.verdict(response_to_proto(denied))
    assert dict(verdict.headers)["x-llm-ratelimit-backend"] == "unavailable"
    reply = answer(verdict, HIT, deny_on_failure=False)
    assert reply.status == 503
    assert orjson.loads(reply.body)["error"]["code"] == "upstream_unavailable"


def test_the_wire_reads_the_rate_limit_services_own_429() -> None:
    limit = Limit("k", 10, "second", name="api_key:default:requests")
    denied = DescriptorOutcome("over_limit", limit, 0, 1.0, 1.0, "api_key")
    proto = response_to_proto(LimitOutcome(False, (denied,), 1, cause=denied))
    verdict = rls_pb.verdict(rls_pb2.RateLimitResponse.FromString(proto.SerializeToString()))
    assert verdict.result == "over_limit"
    assert verdict.body == proto.raw_body
    assert dict(verdict.headers)["retry-after"] == "1"
    assert verdict.statuses == (LimitStatus(10, 1, "api_key:default:requests", 0, 1),)
    check = RateCheck("t", "llm-sidecar", ((("kind", "requests"), ("tenant", "a")),), 1.0,
                      lambda v: HIT)
    sent = rls_pb2.RateLimitRequest.FromString(rls_pb.request(check))
    assert sent.domain == "llm-sidecar" and sent.hits_addend == 0
    assert [(e.key, e.value) for e in sent.descriptors[0].entries] == [("kind", "requests"),
                                                                       ("tenant", "a")]
    assert not sent.descriptors[0].HasField("hits_addend")  # costs 1, as Envoy sends it


def hit_stream(snapshot_: Any, recorder: Recorder) -> Any:
    state = Served(StreamState(snapshot_, SECRET), recorder)
    state.handle("request_headers", {":path": "/v1/embeddings", **JSON_POST,
                                     "authorization": f"Bearer {KEY}"}, b"", False)
    lookup = state.handle("request_body", None,
                          orjson.dumps({"model": "bge-m3", "input": ["a"]}), True)
    assert isinstance(lookup, Lookup)
    return state, state.resume(lookup, (encode_vector(embed("a", 8)),))


def test_a_hit_under_request_limits_asks_the_rate_limiter_before_it_is_answered() -> None:
    recorder = Recorder()
    snapshot_ = snap({"api_key": {"default": {"requests": "10/s", "burst": 20}}},
                     ratelimit="127.0.0.1:7777", ratelimit_timeout_s=0.5)
    state, check = hit_stream(snapshot_, recorder)
    assert isinstance(check, RateCheck)
    assert (check.target, check.domain, check.timeout_s) == ("127.0.0.1:7777", "llm-sidecar", 0.5)
    assert check.descriptors == ((("kind", "requests"), ("api_key", KEY_ID)),)
    assert recorder.records == []  # not answered yet
    reply = state.admit(check, Verdict("over_limit", b"{}", (("retry-after", "2"),)))
    assert isinstance(reply, Reply) and reply.status == 429
    (record,) = recorder.records
    assert outcome(record) == "rate_limited" and record.cache == "hit"
    assert record.charged_tokens == 0 and record.prompt_tokens == 0


def test_a_hit_without_request_limits_is_answered_at_once_and_recorded() -> None:
    recorder = Recorder()
    _, reply = hit_stream(snap({"tenant": {"default": {"tokens": "1k/min"}}}), recorder)
    assert isinstance(reply, Reply) and reply.status == 200
    (record,) = recorder.records
    assert outcome(record) == "ok" and record.cache == "hit"
    assert recorder.routes == []  # answered from the cache: no pool was chosen


def reserve(inputs: list[str], cached: set[str]) -> Continue:
    state = StreamState(snap(), SECRET)
    state.handle("request_headers", {":path": "/v1/embeddings", **JSON_POST}, b"", False)
    lookup = state.handle("request_body", None,
                          orjson.dumps({"model": "bge-m3", "input": inputs}), True)
    assert isinstance(lookup, Lookup)
    distinct = list(dict.fromkeys(inputs))  # the lookup's keys: each input once, in order
    values = tuple(encode_vector(embed(text, 8)) if text in cached else None for text in distinct)
    step = state.resume(lookup, values)
    assert isinstance(step, Continue)
    return step


@pytest.mark.parametrize(("inputs", "cached", "sent"), [
    (["one two three", "four"], set(), ["one two three", "four"]),  # a miss: every input
    (["one two three", "one two three"], set(), ["one two three"] * 2),  # the body as it is
    (["one two three", "four", "one two three"], {"four"}, ["one two three"]),  # missing, once
    (["one two three", "four five"], {"one two three"}, ["four five"]),
])
def test_the_embeddings_reservation_counts_only_what_goes_upstream(
        inputs: list[str], cached: set[str], sent: list[str]) -> None:
    counter = counter_for(None)
    reserved = sum(counter.count(text) for text in sent)
    assert reserve(inputs, cached).metadata[RESERVATION_METADATA_KEY] == reserved
