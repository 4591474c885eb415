"""Which responses extproc reads (issue 16): sampling, Envoy-readable usage, and the path of a
response extproc does not read (its headers only)."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest

from extproc.actions import Continue, ModeOverride
from extproc.bodies import parse_generation
from extproc.sampling import sampled, stable_share, usage_plan
from extproc.stream import StreamState
from extproc.telemetry import RequestRecord
from llm_sidecar.wire_names import DONE_METADATA_KEY, TOKENS_METADATA_KEY
from tests.extproc.helpers import snapshot

LIMITS = {"tenant": {"default": {"tokens": "1M/h"}}}
CANARY = {"llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": {
    "model": "llama-2-13b-v2", "cluster": "vllm-canary", "percent": 100, "sticky": "request"}}}


def test_sampling_takes_the_configured_share_of_request_ids() -> None:
    ids = [str(uuid.UUID(int=i * 7919 + 1)) for i in range(4000)]
    assert not any(sampled(i, 0) for i in ids) and all(sampled(i, 1) for i in ids)
    share = sum(sampled(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [sampled(i, 0.1) for i in ids[:50]] == [sampled(i, 0.1) for i in ids[:50]]


@pytest.mark.parametrize(("sample", "percent", "share"), [
    (0.01, None, 0.01),      # no canary: the configured share
    (0.01, 5, 5 / 95),       # a 5 % canary: as many stable requests read as canary ones
    (0.5, 5, 0.5),           # never below the configured share
    (0.01, 50, 1.0),
    (0.01, 100, 1.0),
    (0.01, 0, 0.01),
])
def test_while_a_model_has_a_canary_its_stable_side_is_read_as_often(
        sample: float, percent: float | None, share: float) -> None:
    assert stable_share(sample, percent) == pytest.approx(share)


def gen(**doc: Any) -> Any:
    return parse_generation("chat", orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **doc}))


@pytest.mark.parametrize(("doc", "reservation", "expected"), [
    ({}, 300, "envoy"),                                                 # JSON: json_to_metadata
    ({}, 262_144, "envoy"),                                             # 8 MiB / 32 bytes a token
    ({}, 262_145, "extproc"),                                           # might pass the buffer
    ({"logprobs": True}, 300, "extproc"),                               # far more bytes a token
    ({"stream": True}, 300, "envoy_injected"),                          # chunk added, stripped
    ({"stream": True, "stream_options": {"include_usage": False}}, 300, "envoy_injected"),
    ({"stream": True, "stream_options": {"include_usage": True}}, 300, "envoy"),
    ({"stream": True, "stream_options": {"include_usage": True,
                                         "continuous_usage_stats": True}}, 300, "extproc"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, 300, "extproc"),
])
def test_envoy_reads_the_usage_only_where_it_can_read_it_whole(
        doc: dict[str, Any], reservation: int, expected: str) -> None:
    assert usage_plan(gen(**doc), reservation, 8 * 1024 * 1024) == expected


class Records:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def request_done(self, record: RequestRecord) -> None:
        self.records.append(record)

    def rejected(self, status: int, code: str) -> None:
        pass

    def routed(self, model: str, cluster: str, variant: str) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        pass


def routed(doc: dict[str, Any], **sections: Any) -> tuple[StreamState, Continue, Records]:
    records = Records()
    state = StreamState(snapshot(**sections), b"secret", telemetry=records)
    state.handle("request_headers", {":path": "/v1/chat/completions", ":method": "POST",
                                     "x-request-id": "r-1"}, b"", False)
    action = state.handle("request_body", None, orjson.dumps(
        {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], **doc}), True)
    assert isinstance(action, Continue)
    return state, action, records


UNREAD = {"rate_limits": LIMITS, "telemetry": {"sample": 0}}


def test_an_unsampled_request_leaves_its_usage_to_envoy_and_asks_for_no_body() -> None:
    state, action, records = routed({"max_tokens": 5}, **UNREAD)
    assert action.metadata["usage"] == "envoy"  # the route with the metadata filters
    answer = state.handle("response_headers", {":status": "200",
                                               "content-type": "application/json"}, b"", False)
    assert answer == Continue(mode=ModeOverride(response_headers=True, response_body="none"))
    [record] = records.records
    assert not record.sampled and record.status == 200 and record.charged_tokens is None
    state.close()  # Envoy's reset after that answer: not an abort, not a second record
    assert len(records.records) == 1


def test_an_unsampled_error_is_settled_to_zero_from_its_headers() -> None:
    state, _, records = routed({"max_tokens": 5}, **UNREAD)
    answer = state.handle("response_headers", {":status": "400",
                                               "content-type": "application/json"}, b"", False)
    assert isinstance(answer, Continue)
    assert answer.metadata == {TOKENS_METADATA_KEY: "0", DONE_METADATA_KEY: "1"}
    assert records.records[0].charged_tokens == 0


def test_an_unsampled_stream_that_did_not_ask_for_usage_gets_it_added_and_stripped() -> None:
    _, action, _ = routed({"stream": True, "stream_options": {"include_usage": False}}, **UNREAD)
    assert action.body is not None
    sent = orjson.loads(action.body)
    assert sent["stream_options"] == {"include_usage": True}
    assert dict(action.set_headers)["content-length"] == str(len(action.body))
    assert action.metadata["usage"] == "envoy" and action.metadata["strip_usage"] == "1"


def test_a_stream_that_asked_for_usage_is_sent_as_it_is() -> None:
    _, action, _ = routed({"stream": True, "stream_options": {"include_usage": True}}, **UNREAD)
    assert action.body is None and "strip_usage" not in action.metadata


@pytest.mark.parametrize(("doc", "sections"), [
    ({"stream": True, "stream_options": {"include_usage": True,
                                         "continuous_usage_stats": True}}, UNREAD),
    ({"stream": True}, {**UNREAD, "telemetry": {"sample": 1}}),   # sampled: nothing injected
    ({"max_tokens": 5}, {**UNREAD, "telemetry": {"sample": 1}}),  # sampled
    ({"max_tokens": 5}, {**UNREAD, "models": CANARY}),            # canary: always measured
    ({"max_tokens": 5}, {**UNREAD, "telemetry": {"sample": 0, "envoy_usage": False}}),
])
def test_extproc_reads_the_response_it_must(doc: dict[str, Any], sections: dict[str, Any]) -> None:
    state, action, records = routed(doc, **sections)
    assert "usage" not in action.metadata
    # Nothing added to the request (the canary's body only gets its model renamed).
    assert action.body is None or "stream_options" not in orjson.loads(action.body)
    answer = state.handle("response_headers", {":status": "200"}, b"", False)
    assert answer == Continue() and not records.records  # the body comes next


def test_without_rate_limits_only_sampling_decides() -> None:
    _, action, _ = routed({"stream": True}, telemetry={"sample": 0})
    assert action.metadata["usage"] == "envoy"  # nothing to settle; no route needs it either
