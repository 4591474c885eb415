"""The embeddings processor with the cache, fed ext_proc messages and lookup results directly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.actions import CacheWrite, Continue, Found, Lookup, ModeOverride, Reply, Step
from extproc.cache.codec import decode_vector, encode_vector
from extproc.cache.keys import KEY_PREFIX
from extproc.stream import StreamState
from sidecar_runtime.wire.names import CLIENT_CREDENTIALS, DONE_METADATA_KEY, TOKENS_METADATA_KEY
from simulator.embeddings import embed, encode_base64
from tests.extproc.helpers import JSON_POST, snapshot

SECRET = b"test-secret"
CACHED: dict[str, Any] = {"kind": "embedding", "clusters": ["embed"],
                          "cache": {"namespace": "bge", "ttl": "1h"}}


def snap(**bge: Any) -> Any:
    models = {"llama-2-13b": {"clusters": ["vllm-short"]}, "bge-m3": {**CACHED, **bge},
              "plain": {"kind": "embedding", "clusters": ["embed"]}}
    return snapshot(models=models)


def start(snapshot_: Any = None, **headers: str) -> StreamState:
    state = StreamState(snapshot_ or snap(), SECRET)
    first = state.handle("request_headers", {":path": "/v1/embeddings", **JSON_POST,
                                             "x-request-id": "r1", **headers}, b"", False)
    # The response is asked for before the model is known (only a headers answer may do it).
    assert first == Continue(mode=ModeOverride(response_headers=True, response_body="streamed"))
    return state


def request(state: StreamState, **doc: Any) -> Step:
    return state.handle("request_body", None, orjson.dumps({"model": "bge-m3", **doc}), True)


def vec(item: str) -> list[float]:
    return embed(item, 8)


def answer(inputs: list[str], encoding: str = "float", model: str = "bge-m3") -> bytes:
    data = [{"object": "embedding", "index": i,
             "embedding": encode_base64(vec(x)) if encoding == "base64" else vec(x)}
            for i, x in enumerate(inputs)]
    return orjson.dumps({"id": "embd-up", "object": "list", "created": 5, "model": model,
                         "data": data, "usage": {"prompt_tokens": 4 * len(inputs),
                                                 "total_tokens": 4 * len(inputs)}})


def respond(state: StreamState, body: bytes, chunks: int = 3,
            status: str = "200") -> tuple[Continue, list[Step], Step]:
    headers = state.handle("response_headers", {":status": status,
                                                "content-type": "application/json"}, b"", False)
    assert isinstance(headers, Continue)
    size = len(body) // chunks + 1
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    middle = [state.handle("response_body", None, part, False) for part in parts[:-1]]
    last = state.handle("response_body", None, parts[-1], True)
    return headers, middle, last


def values_for(lookup: Lookup, cached: dict[str, str]) -> Found:
    """Cached vectors for the inputs named in ``cached`` (key → input text)."""
    return tuple(encode_vector(vec(cached[k])) if k in cached else None for k in lookup.keys)


def first_lookup(state: StreamState, inputs: list[str], **doc: Any) -> Lookup:
    step = request(state, input=inputs, **doc)
    assert isinstance(step, Lookup)
    return step


def test_a_model_without_cache_is_routed_and_charged_what_vllm_used() -> None:
    state = start()
    step = state.handle("request_body", None, orjson.dumps({"model": "plain", "input": ["a"]}), True)
    assert isinstance(step, Continue) and dict(step.set_headers)["x-llm-cluster"] == "embed"
    headers, middle, last = respond(state, answer(["a"]))
    assert headers.set_headers == ()  # no x-llm-cache for a model without a cache
    assert all(m == Continue() for m in middle)
    assert isinstance(last, Continue) and last.body is None and last.store is None
    assert last.metadata == {TOKENS_METADATA_KEY: "4", DONE_METADATA_KEY: "1"}


def test_miss_routes_unchanged_then_stores_each_distinct_vector() -> None:
    state = start()
    lookup = first_lookup(state, ["a", "b", "a"])
    assert len(lookup.keys) == 2 and all(k.startswith(f"{KEY_PREFIX}bge:") for k in lookup.keys)
    action = state.resume(lookup, (None, None))
    assert isinstance(action, Continue) and action.body is None and action.clear_route_cache
    # the answer is read: no gzip; and no client credential goes to the pool
    assert action.remove_headers == ("accept-encoding", *CLIENT_CREDENTIALS)
    assert dict(action.set_headers)["x-llm-cluster"] == "embed"
    headers, middle, last = respond(state, answer(["a", "b", "a"]))
    assert headers.set_headers == (("x-llm-cache", "miss"),)
    assert all(m == Continue() for m in middle)  # chunks flow on as they come
    assert isinstance(last, Continue) and last.body is None
    assert last.metadata == {TOKENS_METADATA_KEY: "12", DONE_METADATA_KEY: "1"}
    assert isinstance(last.store, CacheWrite) and last.store.ttl_s == 3600
    stored = dict(last.store.entries)
    assert set(stored) == set(lookup.keys)
    assert decode_vector(stored[lookup.keys[0]]) == vec("a")
    assert decode_vector(stored[lookup.keys[1]]) == vec("b")


def test_hit_is_answered_by_extproc_with_nothing_charged() -> None:
    state = start()
    lookup = first_lookup(state, ["b", "a", "b"])
    reply = state.resume(lookup, values_for(lookup, dict(zip(lookup.keys, ["b", "a"],
                                                                strict=True))))
    assert isinstance(reply, Reply) and reply.status == 200
    assert dict(reply.headers) == {"content-type": "application/json", "x-llm-cache": "hit"}
    body = orjson.loads(reply.body)
    assert [d["embedding"] for d in body["data"]] == [vec("b"), vec("a"), vec("b")]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["model"] == "bge-m3" and body["id"] == "embd-cache-r1"
    assert body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}


def test_partial_asks_only_for_the_missing_inputs_and_merges_in_order() -> None:
    state = start()
    inputs = ["a", "b", "c", "b", "a"]
    lookup = first_lookup(state, inputs, dimensions=8)
    cached_key = lookup.keys[1]  # "b"
    action = state.resume(lookup, values_for(lookup, {cached_key: "b"}))
    assert isinstance(action, Continue) and action.body is not None
    sent = orjson.loads(action.body)
    assert sent == {"model": "bge-m3", "input": ["a", "c"], "dimensions": 8}
    assert dict(action.set_headers)["content-length"] == str(len(action.body))
    headers, middle, last = respond(state, answer(["a", "c"]))
    assert headers.set_headers == (("x-llm-cache", "partial"),)
    assert all(m == Continue(body=b"") for m in middle)  # held back until the merge
    assert isinstance(last, Continue) and last.body is not None
    merged = orjson.loads(last.body)
    assert [d["embedding"] for d in merged["data"]] == [vec(x) for x in inputs]
    assert [d["index"] for d in merged["data"]] == list(range(5))
    assert merged["usage"]["total_tokens"] == 8 and merged["id"] == "embd-up"
    assert last.metadata == {TOKENS_METADATA_KEY: "8", DONE_METADATA_KEY: "1"}
    assert last.store is not None
    assert {k for k, _ in last.store.entries} == {lookup.keys[0], lookup.keys[2]}


def test_partial_base64_comes_back_as_the_same_strings() -> None:
    state = start()
    lookup = first_lookup(state, ["a", "b"], encoding_format="base64")
    values = (None, encode_vector(encode_base64(vec("b"))))
    action = state.resume(lookup, values)
    assert isinstance(action, Continue)
    _, _, last = respond(state, answer(["a"], "base64"), chunks=1)
    assert isinstance(last, Continue) and last.body is not None
    merged = orjson.loads(last.body)
    assert [d["embedding"] for d in merged["data"]] == [encode_base64(vec("a")),
                                                          encode_base64(vec("b"))]


def test_bypass_routes_unchanged_and_stores_nothing() -> None:
    state = start()
    lookup = first_lookup(state, ["a"])
    action = state.resume(lookup, None)
    assert isinstance(action, Continue) and action.body is None
    headers, _, last = respond(state, answer(["a"]))
    assert headers.set_headers == (("x-llm-cache", "bypass"),)
    assert isinstance(last, Continue) and last.store is None
    assert last.metadata == {TOKENS_METADATA_KEY: "4", DONE_METADATA_KEY: "1"}


@pytest.mark.parametrize("status", ["400", "500", "503"])
def test_an_upstream_error_passes_through_untouched(status: str) -> None:
    state = start()
    state.resume(first_lookup(state, ["a", "b"]), (None, encode_vector(vec("b"))))
    headers = state.handle("response_headers", {":status": status}, b"", False)
    # Passed on as it is, and nothing is kept of the reservation: settled to 0.
    assert headers == Continue(set_headers=(("x-llm-cache", "partial"),),
                               mode=ModeOverride(response_headers=False, response_body="none"),
                               metadata={TOKENS_METADATA_KEY: "0", DONE_METADATA_KEY: "1"})
    assert state.handle("response_body", None, b'{"error": {}}', True) == Continue()


def test_a_partial_answer_that_cannot_be_merged_fails_loudly() -> None:
    state = start()
    state.resume(first_lookup(state, ["a", "b"]), (None, encode_vector(vec("b"))))
    _, _, last = respond(state, answer(["a", "x"]))  # two vectors for one input sent
    assert isinstance(last, Reply) and last.status == 502
    assert orjson.loads(last.body)["error"]["code"] == "upstream_unavailable"


def test_an_unusable_miss_answer_still_passes_and_is_not_stored() -> None:
    state = start()
    state.resume(first_lookup(state, ["a"]), (None,))
    _, _, last = respond(state, b"not json", chunks=1)
    assert isinstance(last, Continue) and last.body is None and last.store is None
    assert last.metadata == {TOKENS_METADATA_KEY: "1", DONE_METADATA_KEY: "1"}  # the request's own estimate


@pytest.mark.parametrize(("share", "namespace"), [(False, "bge@bge-v2"), (True, "bge")])
def test_canary_reads_its_own_namespace_unless_shared(share: bool, namespace: str) -> None:
    cache = {**CACHED["cache"], "share_with_canary": share}
    s = snap(cache=cache, canary={"model": "bge-v2", "cluster": "vllm-canary", "percent": 100})
    state = start(s)
    lookup = first_lookup(state, ["a"])
    assert lookup.keys[0].startswith(f"{KEY_PREFIX}{namespace}:")
    action = state.resume(lookup, (None,))
    assert isinstance(action, Continue) and action.body is not None
    assert orjson.loads(action.body)["model"] == "bge-v2"  # the canary serves under its name
    assert dict(action.set_headers)["x-llm-variant"] == "canary"


def test_a_hit_for_a_canary_names_the_canary_model() -> None:
    s = snap(canary={"model": "bge-v2", "cluster": "vllm-canary", "percent": 100})
    state = start(s)
    lookup = first_lookup(state, ["a"])
    reply = state.resume(lookup, (encode_vector(vec("a")),))
    assert isinstance(reply, Reply) and orjson.loads(reply.body)["model"] == "bge-v2"


def test_bad_requests_never_reach_the_cache() -> None:
    state = start()
    reply = request(state, input=[])
    assert isinstance(reply, Reply) and reply.status == 400


def test_an_exception_while_resuming_becomes_a_500_reply() -> None:
    state = start()
    lookup = first_lookup(state, ["a", "b"])
    reply = state.resume(lookup, (None,))  # the wrong number of values: a bug, not a crash
    assert isinstance(reply, Reply) and reply.status == 500
