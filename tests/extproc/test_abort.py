"""Every routed request is recorded exactly once, also when its stream ends before its response.

The stream state is fed ext_proc messages, then closed as the service closes it when Envoy
resets the stream (client gone, upstream reset) or after the last answer; what it reports is
read as the service hands it to telemetry (:class:`tests.extproc.served.Served`).
"""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.actions import Continue, Lookup
from extproc.records import RouteChosen, outcome
from extproc.stream import StreamState
from extproc.telemetry.metrics import ExtprocMetrics
from sidecar_runtime.wire.names import DONE_METADATA_KEY, RESERVATION_METADATA_KEY, TOKENS_METADATA_KEY
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

SECRET = b"test-secret"
SSE = {":status": "200", "content-type": "text/event-stream"}


def chat(recorder: Recorder, **doc: object) -> Served:
    state = Served(StreamState(snapshot(), SECRET), recorder)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "x-request-id": "r1"}, b"", False)
    body = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], **doc}
    assert isinstance(state.handle("request_body", None, orjson.dumps(body), True), Continue)
    return state


def token(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"delta": {"content": text}}]}) + b"\n\n"


def test_a_stream_reset_mid_response_is_recorded_as_aborted_with_its_streamed_tokens() -> None:
    recorder = Recorder()
    state = chat(recorder, max_tokens=100, stream=True)
    state.handle("response_headers", SSE, b"", False)
    for text in ("a", "b", "c"):
        assert state.handle("response_body", None, token(text), False) == Continue()
    assert recorder.records == []
    state.close()
    (record,) = recorder.records
    assert outcome(record) == "aborted" and record.aborted
    assert record.status == 200 and record.streamed
    assert record.completion_tokens == 3
    assert record.prompt_tokens > 0
    assert record.charged_tokens is None  # nothing settled: the reservation stands
    assert record.ttft_s is not None and record.request_id == "r1"
    state.close()
    assert len(recorder.records) == 1  # closing twice records nothing twice


def test_a_chunk_split_across_messages_is_counted_only_when_complete() -> None:
    recorder = Recorder()
    state = chat(recorder, stream=True)
    state.handle("response_headers", SSE, b"", False)
    whole = token("a") + token("b")
    state.handle("response_body", None, whole[:-5], False)
    state.close()
    assert recorder.records[0].completion_tokens == 1


def test_a_reset_before_the_response_headers_is_aborted_with_no_completion() -> None:
    recorder = Recorder()
    state = chat(recorder, max_tokens=5)
    state.close()
    (record,) = recorder.records
    assert outcome(record) == "aborted" and record.status == 0
    assert record.completion_tokens == 0 and not record.streamed


@pytest.mark.parametrize("ending", ["done", "end_of_stream", "headers_only"])
def test_after_a_normal_end_closing_records_nothing_more(ending: str) -> None:
    recorder = Recorder()
    state = chat(recorder, stream=True)
    if ending == "headers_only":
        state.handle("response_headers", {":status": "503"}, b"", True)
    else:
        state.handle("response_headers", SSE, b"", False)
        state.handle("response_body", None, token("a"), False)
        last = b"data: [DONE]\n\n" if ending == "done" else b""
        state.handle("response_body", None, last, ending == "end_of_stream")
    state.close()
    (record,) = recorder.records
    assert not record.aborted and record.charged_tokens is not None


def test_a_request_never_routed_is_not_a_request_record() -> None:
    recorder = Recorder()
    state = Served(StreamState(snapshot(), SECRET), recorder)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"",
                 False)
    state.close()  # the client left before sending its body
    state2 = Served(StreamState(snapshot(), SECRET), recorder)
    state2.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"",
                  False)
    state2.handle("request_body", None, b"{nope", True)  # a 400: counted as a rejection
    state2.close()
    Served(StreamState(snapshot(), SECRET), recorder).close()  # no message at all
    assert recorder.records == []
    assert [(r.status, r.code) for r in recorder.rejections] == [(400, "invalid_json")]


def test_aborted_requests_count_in_the_metrics_with_their_tokens() -> None:
    registry = CollectorRegistry()
    metrics = ExtprocMetrics(registry, lambda: frozenset({"default"}))
    state = Served(StreamState(snapshot(), SECRET), metrics)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"",
                 False)
    state.handle("request_body", None, orjson.dumps(
        {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
         "stream": True}), True)
    state.handle("response_headers", SSE, b"", False)
    for text in "abcd":
        state.handle("response_body", None, token(text), False)
    state.close()
    labels = {"model": "llama-2-13b", "cluster": "vllm-short", "variant": "stable",
              "tenant": "default"}
    assert registry.get_sample_value("llm_sidecar_requests_total",
                                     {**labels, "outcome": "aborted"}) == 1
    assert registry.get_sample_value(
        "gen_ai_client_token_usage_sum",
        {"model": "llama-2-13b", "variant": "stable", "tenant": "default",
         "token_type": "output"}) == 4


# Embeddings -------------------------------------------------------------------------------

CACHED = {"kind": "embedding", "clusters": ["embed"], "cache": {"namespace": "bge", "ttl": "1h"}}


def embeddings(recorder: Recorder, inputs: list[str], model: str = "bge-m3") -> Served:
    snap = snapshot(models={"bge-m3": CACHED,
                            "plain": {"kind": "embedding", "clusters": ["embed"]}})
    state = Served(StreamState(snap, SECRET), recorder)
    state.handle("request_headers", {":path": "/v1/embeddings", **JSON_POST}, b"", False)
    step = state.handle("request_body", None, orjson.dumps({"model": model, "input": inputs}),
                        True)
    if isinstance(step, Lookup):
        step = state.resume(step, tuple(None for _ in step.keys))  # all missing
    assert isinstance(step, Continue)
    assert step.metadata[RESERVATION_METADATA_KEY] > 0
    return state


@pytest.mark.parametrize("model", ["bge-m3", "plain"])
def test_an_embeddings_request_reset_while_upstream_is_recorded_as_aborted(model: str) -> None:
    recorder = Recorder()
    state = embeddings(recorder, ["alpha", "beta"], model)
    state.handle("response_headers", {":status": "200"}, b"", False)
    state.handle("response_body", None, b'{"data": [', False)
    state.close()
    (record,) = recorder.records
    assert outcome(record) == "aborted" and record.model == model
    assert record.cache == ("miss" if model == "bge-m3" else None)
    assert record.prompt_tokens > 0 and record.charged_tokens is None


def test_a_finished_embeddings_request_is_recorded_once_with_vllms_usage() -> None:
    recorder = Recorder()
    state = embeddings(recorder, ["alpha"])
    state.handle("response_headers", {":status": "200"}, b"", False)
    answer = orjson.dumps({"data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                           "usage": {"prompt_tokens": 7, "total_tokens": 7}})
    last = state.handle("response_body", None, answer, True)
    assert isinstance(last, Continue) and last.metadata == {TOKENS_METADATA_KEY: "7", DONE_METADATA_KEY: "1"}
    state.close()
    (record,) = recorder.records
    assert outcome(record) == "ok" and record.prompt_tokens == 7 and record.charged_tokens == 7
    assert recorder.routes == [RouteChosen("bge-m3", "embed", "stable")]  # once, at the lookup


def test_an_embeddings_error_from_upstream_is_recorded_as_such() -> None:
    recorder = Recorder()
    state = embeddings(recorder, ["alpha"])
    state.handle("response_headers", {":status": "429"}, b"", False)
    state.close()
    (record,) = recorder.records
    assert outcome(record) == "rate_limited" and record.charged_tokens == 0


def test_time_to_first_token_counts_from_the_routed_body_not_the_clients_upload() -> None:
    """A client that sends its body 2 s after its headers does not make the pool look 2 s slow
    (one such stream could trip, or mask, the canary guard's p99)."""
    now = [10.0]
    recorder = Recorder()
    state = Served(StreamState(snapshot(), SECRET, clock=lambda: now[0]), recorder)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST},
                 b"", False)
    now[0] += 2.0  # the upload
    body = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "max_tokens": 2}
    state.handle("request_body", None, orjson.dumps(body), True)
    now[0] += 0.05  # the pool's time to its first token
    state.handle("response_headers", SSE, b"", False)
    state.handle("response_body", None, token("a"), False)
    state.handle("response_body", None, b"data: [DONE]\n\n", True)
    (record,) = recorder.records
    assert record.ttft_s == pytest.approx(0.05)
    assert record.duration_s == pytest.approx(2.05)  # what the client waited, as before


@pytest.mark.parametrize(("n", "chunks", "tokens_per_chunk"), [(1, 5, 1), (2, 10, 1), (1, 3, 4)])
def test_time_per_output_token_is_per_sequence(n: int, chunks: int, tokens_per_chunk: int) -> None:
    """n choices decode side by side and a chunk may carry several tokens (vLLM's
    --stream-interval): the time per output token is the stream's time over one sequence's
    tokens as the usage counts them, not over the chunks of every choice (which gave 1/n)."""
    now = [0.0]
    recorder = Recorder()
    state = Served(StreamState(snapshot(), SECRET, clock=lambda: now[0]), recorder)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"", False)
    body = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], "n": n,
            "max_tokens": 100, "stream": True, "stream_options": {"include_usage": True}}
    state.handle("request_body", None, orjson.dumps(body), True)
    state.handle("response_headers", SSE, b"", False)
    for k in range(chunks):
        now[0] = 1.0 + 0.1 * k  # one chunk every 0.1 s, the first at 1 s
        state.handle("response_body", None, token("w" * tokens_per_chunk), False)
    generated = chunks * tokens_per_chunk
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": generated,
                                      "total_tokens": 9 + generated}}
    state.handle("response_body", None, b"data: " + orjson.dumps(usage) + b"\n\n", False)
    state.handle("response_body", None, b"data: [DONE]\n\n", True)
    (record,) = recorder.records
    per_sequence = generated / n
    assert record.tpot_s == pytest.approx(0.1 * (chunks - 1) / (per_sequence - 1))
