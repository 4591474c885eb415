"""Which responses extproc reads (issue 16): sampling, Envoy-readable usage, and the path of a
response extproc does not read (its headers only)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import orjson
import pytest

from extproc.actions import Continue, ModeOverride
from extproc.bodies import parse_generation
from extproc.sampling import sampled, stable_share, usage_plan
from extproc.stream import StreamState
from sidecar_runtime.wire.names import DONE_METADATA_KEY, ENVOY_USAGE_HEADER, TOKENS_METADATA_KEY
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

LIMITS = {"tenant": {"default": {"tokens": "1M/h"}}}
CANARY = {"llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": {
    "model": "llama-2-13b-v2", "cluster": "vllm-canary", "percent": 100, "sticky": "request"}}}


def test_sampling_takes_the_configured_share_of_request_ids() -> None:
    ids = [str(uuid.UUID(int=i * 7919 + 1)) for i in range(4000)]
    assert not any(sampled(i, 0) for i in ids) and all(sampled(i, 1) for i in ids)
    share = sum(sampled(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [sampled(i, 0.1) for i in ids[:50]] == [sampled(i, 0.1) for i in ids[:50]]


def test_sampling_is_the_same_keyed_hash_on_every_replica() -> None:
    """Replicas (of this version or the last) sample the same request ids: blake2b of 8 bytes
    personalised ``llm-sample``, mod 10,000, below the share's ten-thousandths."""
    for i in range(2000):
        request_id = str(uuid.UUID(int=i * 104729 + 3))
        digest = hashlib.blake2b(request_id.encode(), digest_size=8,
                                 person=b"llm-sample").digest()
        for share in (0.001, 0.05, 0.5, 0.9999):
            want = int.from_bytes(digest, "big") % 10_000 < round(share * 10_000)
            assert sampled(request_id, share) == want


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


@pytest.mark.parametrize(("doc", "expected"), [
    ({}, "extproc"),                                                    # one body message
    ({"stream": True}, "envoy_injected"),                               # chunk added, stripped
    ({"stream": True, "stream_options": {"include_usage": False}}, "envoy_injected"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "envoy"),
    ({"stream": True, "stream_options": {"include_usage": True,
                                         "continuous_usage_stats": True}}, "extproc"),
    # vLLM's include_usage defaults to true once stream_options is sent; null is false.
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "extproc"),
    ({"stream": True, "stream_options": {}}, "envoy"),
    ({"stream": True, "stream_options": {"include_usage": None}}, "envoy_injected"),
    # Per-chunk usage without include_usage is nothing to vLLM: a stream without usage.
    ({"stream": True, "stream_options": {"include_usage": False,
                                         "continuous_usage_stats": True}}, "envoy_injected"),
])
def test_envoy_reads_the_usage_of_streams(doc: dict[str, Any], expected: str) -> None:
    assert usage_plan(gen(**doc)) == expected


def routed(doc: dict[str, Any], *, marker: bool = True, **sections: Any
           ) -> tuple[Served, Continue, Recorder]:
    """``marker``: the request came through an Envoy that reads usage (the bootstrap's
    ``x-llm-envoy-usage``)."""
    records = Recorder()
    state = Served(StreamState(snapshot(**sections), b"secret"), records)
    headers = {":path": "/v1/chat/completions", **JSON_POST, "x-request-id": "r-1"}
    if marker:
        headers[ENVOY_USAGE_HEADER] = "1"
    state.handle("request_headers", headers, b"", False)
    action = state.handle("request_body", None, orjson.dumps(
        {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], **doc}), True)
    assert isinstance(action, Continue)
    return state, action, records


UNREAD: dict[str, Any] = {"rate_limits": LIMITS, "telemetry": {"sample": 0, "envoy_usage": True}}


ASKED = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 256}
NO_BODY = Continue(mode=ModeOverride(response_headers=True, response_body="none"))
SSE = {":status": "200", "content-type": "text/event-stream"}


def test_an_unsampled_stream_leaves_its_usage_to_envoy_and_asks_for_no_body() -> None:
    state, action, records = routed(ASKED, **UNREAD)
    assert action.body is None and "strip_usage" not in action.metadata  # sent as it is
    assert state.handle("response_headers", SSE, b"", False) == NO_BODY
    [record] = records.records
    assert not record.sampled and record.status == 200 and record.charged_tokens is None
    state.close()  # Envoy's reset after that answer: not an abort, not a second record
    assert len(records.records) == 1


USAGE_EVENT = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"total_tokens":30}}\n\n'
TOKEN_EVENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


def test_without_envoys_marker_extproc_reads_the_stream_and_strips_what_it_added() -> None:
    """An Envoy without the usage filters (Istio's EnvoyFilter) says nothing: extproc does not
    leave the usage to it, whatever the YAML says. It asks vLLM for the usage chunk, settles
    with it, and takes it out of the client's stream itself (no Lua filter will)."""
    state, action, records = routed({"stream": True, "max_tokens": 9}, marker=False, **UNREAD)
    assert action.body is not None and "strip_usage" not in action.metadata
    assert orjson.loads(action.body)["stream_options"] == {"include_usage": True}
    answer = state.handle("response_headers", SSE, b"", False)
    assert answer != NO_BODY  # it goes on reading the body
    assert state.handle("response_body", None, TOKEN_EVENT, False) == Continue()
    # The usage event split across chunks: nothing of it reaches the client.
    head, tail = USAGE_EVENT[:30], USAGE_EVENT[30:]
    held = state.handle("response_body", None, TOKEN_EVENT + head, False)
    assert isinstance(held, Continue) and held.body == TOKEN_EVENT
    end = state.handle("response_body", None, tail + b"data: [DONE]\n\n", False)
    assert isinstance(end, Continue) and end.body == b"data: [DONE]\n\n"
    assert end.metadata[TOKENS_METADATA_KEY] == "30"
    assert records.records[0].charged_tokens == 30


def test_a_client_that_asked_for_usage_keeps_it_where_extproc_reads() -> None:
    asked = {"stream": True, "max_tokens": 9, "stream_options": {"include_usage": True}}
    state, action, _ = routed(asked, marker=False, **UNREAD)
    assert action.body is None
    state.handle("response_headers", SSE, b"", False)
    end = state.handle("response_body", None, USAGE_EVENT + b"data: [DONE]\n\n", False)
    assert isinstance(end, Continue) and end.body is None


def test_an_unsampled_error_is_settled_to_zero_from_its_headers() -> None:
    state, _, records = routed(ASKED, **UNREAD)
    answer = state.handle("response_headers", {":status": "400",
                                               "content-type": "application/json"}, b"", False)
    assert isinstance(answer, Continue)
    assert answer.metadata == {TOKENS_METADATA_KEY: "0", DONE_METADATA_KEY: "1"}
    assert records.records[0].charged_tokens == 0


def test_an_unsampled_stream_that_did_not_ask_for_usage_gets_it_added_and_stripped() -> None:
    state, action, _ = routed({"stream": True, "stream_options": {"include_usage": False}},
                              **UNREAD)
    assert action.body is not None
    sent = orjson.loads(action.body)
    assert sent["stream_options"] == {"include_usage": True}
    assert dict(action.set_headers)["content-length"] == str(len(action.body))
    assert action.metadata["strip_usage"] == "1"
    assert state.handle("response_headers", SSE, b"", False) == NO_BODY


@pytest.mark.parametrize(("doc", "sections"), [
    ({"stream": True, "stream_options": {"include_usage": True,
                                         "continuous_usage_stats": True}}, UNREAD),
    ({"max_tokens": 5}, UNREAD),                                   # not streamed: one message
    (ASKED, {**UNREAD, "models": CANARY}),                         # canary: always measured
    (ASKED, {**UNREAD, "telemetry": {"sample": 0, "envoy_usage": False}}),
])
def test_extproc_reads_the_response_it_must(doc: dict[str, Any], sections: dict[str, Any]) -> None:
    state, action, records = routed(doc, **sections)
    assert "strip_usage" not in action.metadata
    # Nothing added to the request (the canary's body only gets its model renamed).
    sent = doc if action.body is None else orjson.loads(action.body)
    assert sent.get("stream_options") == doc.get("stream_options")
    answer = state.handle("response_headers", SSE, b"", False)
    assert answer == Continue() and not records.records  # the body comes next


def test_a_sampled_stream_is_read_by_extproc_and_still_settled_from_vllms_usage() -> None:
    """extproc reads it (timings), vLLM is asked for the usage chunk, Envoy settles with it and
    its Lua filter takes it out after extproc has read it."""
    state, action, records = routed({"stream": True, "max_tokens": 9},
                                    **{**UNREAD, "telemetry": {"sample": 1}})
    assert action.body is not None and action.metadata["strip_usage"] == "1"
    assert orjson.loads(action.body)["stream_options"] == {"include_usage": True}
    assert state.handle("response_headers", SSE, b"", False) == Continue()
    end = state.handle("response_body", None, TOKEN_EVENT + USAGE_EVENT + b"data: [DONE]\n\n",
                       False)
    assert isinstance(end, Continue) and end.body is None  # passed as vLLM sent it
    assert end.settle is None  # Envoy's stream-done call settles it
    assert records.records[0].charged_tokens == 30


def test_without_rate_limits_only_sampling_decides() -> None:
    state, _, _ = routed({"max_tokens": 5}, telemetry={"sample": 0})
    assert state.handle("response_headers", {":status": "200"}, b"", False) == NO_BODY
