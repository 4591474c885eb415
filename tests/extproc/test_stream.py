"""The ext_proc stream state fed messages directly: no gRPC, no Envoy."""

from __future__ import annotations

import orjson
import pytest
from structlog.testing import capture_logs

from extproc.actions import Continue, Reply
from extproc.context import spoofed_headers
from extproc.records import Rejection, RouteChosen
from extproc.stream import StreamState
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

SECRET = b"test-secret"


def start(path: str = "/v1/chat/completions", method: str = "POST",
          **headers: str) -> StreamState:
    state = StreamState(snapshot(), SECRET)
    action = state.handle("request_headers", {":path": path, ":method": method,
                                              "content-type": "application/json", **headers},
                          b"", False)
    assert isinstance(action, Continue)
    return state


def body(state: StreamState | Served, doc: object) -> Continue | Reply:
    """The answer to the request body; the snapshot has no cache and no limits, so it is never
    a lookup or a rate check."""
    raw = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    step = state.handle("request_body", None, raw, True)
    assert isinstance(step, Continue | Reply), step
    return step


def chat_doc(content: str = "hello", **extra: object) -> dict[str, object]:
    return {"model": "llama-2-13b", "messages": [{"role": "user", "content": content}], **extra}


def test_chat_sets_every_routing_header_and_clears_the_route() -> None:
    action = body(start(), chat_doc(max_tokens=10))
    assert isinstance(action, Continue)
    headers = dict(action.set_headers)
    assert headers["x-llm-cluster"] == "vllm-short"
    assert headers["x-llm-variant"] == "stable"
    assert headers["x-llm-tenant"] == "default"
    assert headers["x-llm-key-id"] == "anonymous"
    assert action.clear_route_cache and action.body is None
    # Envoy's pool routes match this metadata, never the header a client could send.
    assert action.metadata["cluster"] == "vllm-short"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_trailers_without_a_body_are_a_400(path: str) -> None:
    """HTTP/2 HEADERS then trailers only: no body message ever comes, the trailers decide."""
    state = start(path)
    action = state.handle("request_trailers", None, b"", True)
    assert isinstance(action, Reply) and action.status == 400
    assert orjson.loads(action.body)["error"]["code"] == "invalid_json"


def test_trailers_after_a_body_pass() -> None:
    state = start()
    routed = body(state, chat_doc())
    assert isinstance(routed, Continue) and routed.metadata["cluster"] == "vllm-short"
    assert state.handle("request_trailers", None, b"", True) == Continue()


def test_spoofed_llm_headers_are_removed_and_ignored() -> None:
    state = StreamState(snapshot(), SECRET)
    first = state.handle("request_headers", {
        ":path": "/v1/chat/completions", **JSON_POST, "x-llm-cluster": "vllm-long",
        "x-llm-tenant": "vip"}, b"", False)
    assert isinstance(first, Continue)
    assert set(first.remove_headers) == {"x-llm-cluster", "x-llm-tenant"}
    action = body(state, chat_doc())
    assert isinstance(action, Continue)
    assert dict(action.set_headers)["x-llm-cluster"] == "vllm-short"
    assert dict(action.set_headers)["x-llm-tenant"] == "default"


def test_which_inbound_headers_count_as_spoofed() -> None:
    """Only extproc may send x-llm-* and the endpoint picker's headers upstream; Envoy's own
    x-llm-envoy-usage is not one of them (see :func:`extproc.context.spoofed_headers`)."""
    names = ["x-llm-cluster", "x-llm-", "x-llm-envoy-usage", "x-llm-envoy-usage-2",
             "x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served",
             "x-gateway-destination", "x-llmcluster", "authorization", ":path", "x-api-key"]
    assert spoofed_headers(dict.fromkeys(names, "v")) == (
        "x-llm-cluster", "x-llm-", "x-llm-envoy-usage-2", "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-served")


@pytest.mark.parametrize(("raw", "status", "code"), [
    (b"{nope", 400, "invalid_json"),
    (b"[]", 400, "invalid_json"),
    (b"", 400, "invalid_json"),
    (b'{"messages": []}', 400, "invalid_request"),
    (b'{"model": null, "messages": []}', 400, "invalid_request"),
    (b'{"model": "x", "messages": [{"role": "user", "content": "a"}]}', 404, "model_not_found"),
    (b'{"model": "bge-m3", "messages": [{"role": "user", "content": "a"}]}', 400,
     "model_not_supported"),
    (b'{"model": "llama-2-13b", "messages": "hi"}', 400, "invalid_request"),
    (b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "a"}], '
     b'"max_tokens": "5"}', 400, "invalid_request"),
    (b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "a"}], '
     b'"max_tokens": 40000}', 413, "context_length_exceeded"),
    (b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "a"}], '
     b'"stream": "yes"}', 400, "invalid_request"),
    (b'\xff\xfe', 400, "invalid_json"),
])
def test_bad_bodies_get_openai_errors(raw: bytes, status: int, code: str) -> None:
    action = body(start(), raw)
    assert isinstance(action, Reply)
    assert action.status == status
    payload = orjson.loads(action.body)
    assert payload["error"]["code"] == code
    assert set(payload["error"]) == {"message", "type", "param", "code"}


def test_completions_with_token_ids_count_each_id() -> None:
    action = body(start("/v1/completions"), {"model": "llama-2-13b", "prompt": [1] * 2000,
                                             "max_tokens": 100})
    assert isinstance(action, Continue)
    assert dict(action.set_headers)["x-llm-cluster"] == "vllm-long"
    assert dict(action.set_headers)["x-llm-context-length"] == "2100"


def test_embeddings_route_by_longest_input() -> None:
    action = body(start("/v1/embeddings"), {"model": "bge-m3", "input": ["a", "b" * 300]})
    assert isinstance(action, Continue)
    assert dict(action.set_headers)["x-llm-cluster"] == "embed"


def test_model_list_is_answered_by_extproc() -> None:
    state = StreamState(snapshot(), SECRET)
    action = state.handle("request_headers", {":path": "/v1/models", ":method": "GET"}, b"", True)
    assert isinstance(action, Reply) and action.status == 200
    assert {m["id"] for m in orjson.loads(action.body)["data"]} == {"llama-2-13b", "bge-m3"}


@pytest.mark.parametrize(("path", "method", "status"), [
    ("/v1/nope", "POST", 404), ("/v1/chat/completions", "GET", 405), ("/", "GET", 404),
])
def test_unknown_paths_and_methods(path: str, method: str, status: int) -> None:
    state = StreamState(snapshot(), SECRET)
    action = state.handle("request_headers", {":path": path, ":method": method}, b"", True)
    assert isinstance(action, Reply) and action.status == status


def test_a_post_without_body_is_400() -> None:
    state = StreamState(snapshot(), SECRET)
    action = state.handle("request_headers",
                          {":path": "/v1/chat/completions", **JSON_POST}, b"", True)
    assert isinstance(action, Reply) and action.status == 400


@pytest.mark.parametrize(("path", "encoding", "refused"), [
    ("/v1/chat/completions", "gzip", True), ("/v1/embeddings", "br", True),
    ("/v1/completions", " GZIP ", True), ("/v1/chat/completions", "identity", False),
    ("/v1/chat/completions", None, False),
])
def test_a_compressed_body_is_a_415_that_says_so(path: str, encoding: str | None,
                                                 refused: bool) -> None:
    """Neither extproc nor vLLM decompresses a request body: a gzip body used to be read as
    JSON and refused as "str is not valid UTF-8". Now it is refused at its headers, by name."""
    state = StreamState(snapshot(), SECRET)
    headers = {":path": path, **JSON_POST}
    if encoding is not None:
        headers["content-encoding"] = encoding
    action = state.handle("request_headers", headers, b"", False)
    assert isinstance(action, Reply) is refused
    if isinstance(action, Reply):
        assert encoding is not None
        error = orjson.loads(action.body)["error"]
        assert (action.status, error["code"], error["param"]) == (
            415, "unsupported_content_encoding", "content-encoding")
        assert error["message"].startswith(
            f"Request bodies with content-encoding {encoding.strip().lower()!r}")


@pytest.mark.parametrize(("path", "content_type", "refused"), [
    ("/v1/chat/completions", "application/json", False),
    ("/v1/embeddings", " Application/JSON ; charset=utf-8", False),
    ("/v1/completions", None, True),  # curl -d without -H, or a raw client
    ("/v1/chat/completions", "application/x-www-form-urlencoded", True),  # curl -d's default
    ("/v1/embeddings", "text/plain", True),
    ("/v1/chat/completions", "application/merge-patch+json", True),
    ("/v1/chat/completions", "", True),
])
def test_a_body_that_is_not_application_json_is_a_415_before_any_work(
        path: str, content_type: str | None, refused: bool) -> None:
    """vLLM refuses any other media type (a missing one too); refused at the headers, such a
    request no longer reaches a pod, and spends no rate limit, only to be refused there."""
    state = StreamState(snapshot(), SECRET)
    headers = {":path": path, ":method": "POST"}
    if content_type is not None:
        headers["content-type"] = content_type
    action = state.handle("request_headers", headers, b"", False)
    assert isinstance(action, Reply) is refused
    if isinstance(action, Reply):
        error = orjson.loads(action.body)["error"]
        assert (action.status, error["code"], error["param"]) == (
            415, "unsupported_media_type", "content-type")
        assert "Only 'application/json' is allowed" in error["message"]


def test_required_auth_rejects_unknown_keys_before_the_body() -> None:
    import hashlib
    snap = snapshot(auth={"required": True},
                    api_keys=[{"name": "bot", "sha256": hashlib.sha256(b"sk-good").hexdigest(),
                               "tenant": "legal"}])
    state = StreamState(snap, SECRET)
    action = state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                              "authorization": "Bearer sk-bad"}, b"", False)
    assert isinstance(action, Reply) and action.status == 401
    state = StreamState(snap, SECRET)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "authorization": "Bearer sk-good"}, b"", False)
    ok = body(state, chat_doc())
    assert isinstance(ok, Continue)
    assert dict(ok.set_headers)["x-llm-tenant"] == "legal"
    assert "sk-good" not in repr(ok)


def test_messages_out_of_order_pass_through() -> None:
    state = StreamState(snapshot(), SECRET)
    assert isinstance(state.handle("response_body", None, b"x", True), Continue)


def test_a_stream_is_recorded_and_charged_at_done_even_if_its_end_never_arrives() -> None:
    recorder = Recorder()
    records = recorder.records
    state = Served(StreamState(snapshot(), SECRET), recorder)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"",
                 False)
    body(state, chat_doc(max_tokens=2, stream=True))
    state.handle("response_headers", {":status": "200", "content-type": "text/event-stream"},
                 b"", False)
    chunk = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
    assert state.handle("response_body", None, chunk, False) == Continue()
    done = state.handle("response_body", None,
                        b'data: {"choices":[],"usage":{"total_tokens":7}}\n\ndata: [DONE]\n\n',
                        False)
    assert isinstance(done, Continue) and done.metadata["llm_tokens"] == "7"
    assert len(records) == 1
    # The end of stream, if it still comes, records and charges nothing twice.
    assert state.handle("response_body", None, b"", True) == Continue()
    assert len(records) == 1


def test_a_bad_tenant_header_is_an_openai_400_before_the_body() -> None:
    state = StreamState(snapshot(), SECRET)
    action = state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                              "x-tenant-id": "\uff4c\uff45\uff47\uff41\uff4c"}, b"", False)
    assert isinstance(action, Reply) and action.status == 400
    error = orjson.loads(action.body)["error"]
    assert (error["code"], error["param"]) == ("invalid_tenant", "x-tenant-id")
    assert dict(action.headers)["content-type"] == "application/json"


def routed(path: str, doc: dict[str, object]) -> Continue:
    action = body(start(path), doc)
    assert isinstance(action, Continue), action
    return action


# "hello" is ceil(5 / 3) = 2 tokens, plus 8 per message and 8 per chat prompt: 18.
@pytest.mark.parametrize(("path", "doc", "reservation"), [
    ("/v1/chat/completions", chat_doc(max_tokens=10), 18 + 10),
    ("/v1/chat/completions", chat_doc(), 18 + 256),  # the model's default_max_tokens
    ("/v1/chat/completions", chat_doc(max_completion_tokens=0), 18 + 256),
    ("/v1/chat/completions", chat_doc(max_completion_tokens=0, max_tokens=7), 18 + 7),
    ("/v1/chat/completions", chat_doc(max_tokens=10, n=3), 18 + 30),
    ("/v1/chat/completions", chat_doc(max_tokens=10, n=2, best_of=4), 18 + 40),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": "abcdef", "max_tokens": 5}, 2 + 5),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": ["abc", "abcdef"], "max_tokens": 5,
                         "n": 2}, 1 + 2 + 5 * 2 * 2),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": [[1, 2, 3], [4]] * 3, "max_tokens": 1},
     12 + 6),
])
def test_the_reservation_is_dynamic_metadata_of_the_request_body(
        path: str, doc: dict[str, object], reservation: int) -> None:
    metadata = routed(path, doc).metadata
    assert metadata["llm_reservation"] == reservation
    # A fresh random lease per request: no client can name another request's lease.
    assert len(metadata["llm_lease"]) == 24
    assert metadata["llm_lease"] != routed(path, doc).metadata["llm_lease"]


def test_max_completion_tokens_0_no_longer_buys_high_priority() -> None:
    # 6000 bytes: 2000 tokens + 16. With output 0 the weight was 0 (high); vLLM reads 0 as
    # "not set", so the default 256 applies: 2016 x 256 / 1000 = 516 (medium).
    headers = dict(routed("/v1/chat/completions",
                          chat_doc("x" * 6000, max_completion_tokens=0)).set_headers)
    assert (headers["x-llm-priority"], headers["x-llm-context-length"]) == ("medium", "2272")


def test_choices_weigh_in_priority_but_not_in_the_context() -> None:
    # 1500 bytes: 500 + 16 tokens; 516 x 10 / 1000 is high, with n = 128 it is 660: medium.
    one = dict(routed("/v1/chat/completions", chat_doc("x" * 1500, max_tokens=10)).set_headers)
    many = dict(routed("/v1/chat/completions",
                       chat_doc("x" * 1500, max_tokens=10, n=128)).set_headers)
    assert (one["x-llm-priority"], many["x-llm-priority"]) == ("high", "medium")
    assert one["x-llm-context-length"] == many["x-llm-context-length"] == "526"


@pytest.mark.parametrize(("path", "doc", "param"), [
    ("/v1/chat/completions", chat_doc(n=100_000), "n"),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": "x", "best_of": 129}, "best_of"),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": [[7]] * 1_000_000}, "prompt"),
    ("/v1/completions", {"model": "llama-2-13b", "prompt": [7] * 1_000_001}, "prompt"),
])
def test_bounds_are_openai_400s(path: str, doc: dict[str, object], param: str) -> None:
    action = body(start(path), doc)
    assert isinstance(action, Reply) and action.status == 400
    error = orjson.loads(action.body)["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "invalid_request", param)


def test_the_stream_reports_by_the_values_it_returns() -> None:
    """No telemetry is handed in: the answer that routes carries the route, the one that
    answers a client error its rejection, and close returns an aborted request's record once."""
    state = start(**{"x-request-id": "r9"})
    routed = body(state, chat_doc(stream=True))
    assert isinstance(routed, Continue) and routed.record is None
    assert routed.route == RouteChosen("llama-2-13b", "vllm-short", "stable")
    reading = state.handle("response_headers", {":status": "200",
                                                "content-type": "text/event-stream"}, b"", False)
    assert isinstance(reading, Continue) and reading.record is None and reading.route is None
    record = state.close()
    assert record is not None and record.aborted and record.request_id == "r9"
    assert state.close() is None  # once

    rejected = body(start(), b"{nope")
    assert isinstance(rejected, Reply) and rejected.record is None
    assert rejected.rejection == Rejection(400, "invalid_json")
    unknown = body(start(), chat_doc(model="no-such-model"))
    assert isinstance(unknown, Reply) and unknown.rejection == Rejection(404, "model_not_found")


def test_an_internal_error_is_no_client_rejection() -> None:
    state = start()
    body(state, chat_doc())
    # A second body is a message the request's phase does not expect: a bug, not the client's.
    again = body(state, chat_doc())
    assert isinstance(again, Reply) and again.status == 500 and again.rejection is None


def nested(depth: int) -> bytes:
    """A JSON value nested ``depth`` levels deep (orjson reads 1,024, writes 255)."""
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("path", "raw"), [
    # counted as prompt text (a tools schema):
    ("/v1/chat/completions", b'{"model": "llama-2-13b", "messages": [{"role": "user", '
                             b'"content": "hi"}], "tools": ' + nested(300) + b"}"),
    # passed on only, but the body is rewritten (a canary, a budget, priority):
    ("/v1/chat/completions", b'{"model": "llama-2-13b", "max_tokens": 4, "priority": 1, '
                             b'"messages": [{"role": "user", "content": "hi"}], '
                             b'"guided_json": ' + nested(300) + b"}"),
])
def test_a_body_nested_deeper_than_the_gateway_writes_is_a_400_not_a_500(
        path: str, raw: bytes) -> None:
    """vLLM would read it, the gateway cannot write it back: the client learns why."""
    with capture_logs() as logs:
        answer = start(path).handle("request_body", None, raw, True)
    assert isinstance(answer, Reply) and answer.status == 400
    error = orjson.loads(answer.body)["error"]
    assert (error["code"], error["type"]) == ("invalid_json", "invalid_request_error")
    assert "255 levels" in error["message"]
    assert [e for e in logs if e["log_level"] == "error"] == []  # not an internal error


def test_a_body_nested_to_the_writable_depth_is_served() -> None:
    raw = (b'{"model": "llama-2-13b", "max_tokens": 4, "priority": 1, "messages": '
           b'[{"role": "user", "content": "hi"}], "guided_json": ' + nested(250) + b"}")
    answer = start().handle("request_body", None, raw, True)
    assert isinstance(answer, Continue) and answer.body is not None


def test_a_query_never_reaches_a_pool() -> None:
    """A client's key in the query (``?key=sk-...``) would land in vLLM's access log."""
    def headers_answer(path: str) -> dict[str, str]:
        action = StreamState(snapshot(), SECRET).handle(
            "request_headers", {":path": path, **JSON_POST}, b"", False)
        assert isinstance(action, Continue)
        return dict(action.set_headers)

    assert headers_answer("/v1/chat/completions?key=sk-q")[":path"] == "/v1/chat/completions"
    assert ":path" not in headers_answer("/v1/chat/completions")
