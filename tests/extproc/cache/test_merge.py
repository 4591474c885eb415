"""Hit, partial and miss: the body sent upstream and the answer merged back in input order."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.cache.codec import encode_vector
from extproc.cache.keys import KeyPlan, plan_keys, request_salt
from extproc.cache.merge import (
    MergeError,
    entries_to_store,
    hit_body,
    merged_body,
    missing_body,
    outcome_of,
    parse_response,
    resolve,
    upstream_vectors,
    usage_tokens,
)
from simulator.embeddings import embed


def vec(item: str | tuple[int, ...]) -> list[float]:
    return embed(item if isinstance(item, str) else "ids" + repr(item), 8)


def plan(*inputs: str | tuple[int, ...]) -> KeyPlan:
    return plan_keys("ns", request_salt(None, "float", {}), inputs)


def found(p: KeyPlan, cached: set[str | tuple[int, ...]]) -> list[bytes | None]:
    return [encode_vector(vec(p.items[k])) if p.items[k] in cached else None for k in p.distinct]


def upstream(inputs: list[Any]) -> bytes:
    """What vLLM answers for ``inputs`` (data deliberately out of order, as nothing promises it)."""
    data = [{"object": "embedding", "index": i, "embedding": vec(x if isinstance(x, str)
                                                                 else tuple(x))}
            for i, x in enumerate(inputs)]
    return orjson.dumps({"id": "embd-1", "object": "list", "created": 1, "model": "bge-m3",
                         "data": list(reversed(data)),
                         "usage": {"prompt_tokens": 3 * len(inputs), "total_tokens": 3 * len(inputs)}})


@pytest.mark.parametrize(("values", "outcome"), [
    ([b"x", b"y"], "hit"), ([None, b"y"], "partial"), ([None, None], "miss"), ([], "hit"),
])
def test_outcome_of_raw_values(values: list[bytes | None], outcome: str) -> None:
    assert outcome_of(values) == outcome


def test_all_cached_is_a_hit_answered_in_order_with_duplicates() -> None:
    p = plan("a", "b", "a")
    resolution = resolve(p, found(p, {"a", "b"}))
    assert resolution.outcome == "hit" and resolution.missing == ()
    body = orjson.loads(hit_body(resolution, "bge-m3", "embd-cache-r1"))
    assert body["object"] == "list" and body["model"] == "bge-m3" and body["id"] == "embd-cache-r1"
    assert body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [vec("a"), vec("b"), vec("a")]
    assert all(d["object"] == "embedding" for d in body["data"])


def test_partial_sends_each_missing_input_once_and_merges_back_in_order() -> None:
    inputs = ("c", "a", "b", "c", "d", "a")
    p = plan(*inputs)
    resolution = resolve(p, found(p, {"a"}))
    assert resolution.outcome == "partial"
    doc = {"model": "bge-m3", "input": list(inputs), "dimensions": 8, "user": "u"}
    sent_doc = orjson.loads(missing_body(doc, resolution))
    assert sent_doc == {"model": "bge-m3", "input": ["c", "b", "d"], "dimensions": 8, "user": "u"}
    answer = parse_response(upstream(sent_doc["input"]))
    fresh = upstream_vectors(answer, resolution.missing)
    merged = orjson.loads(merged_body(answer, resolution, fresh))
    assert [d["index"] for d in merged["data"]] == list(range(6))
    assert [d["embedding"] for d in merged["data"]] == [vec(x) for x in inputs]
    # vLLM's own fields survive; usage is what vLLM computed (the missing inputs only).
    assert merged["id"] == "embd-1" and merged["created"] == 1 and merged["usage"]["total_tokens"] == 9
    assert {k for k, _ in entries_to_store(fresh)} == set(resolution.missing)


def test_partial_with_token_ids_rewrites_them_as_lists() -> None:
    inputs = ((1, 2), (3,), (1, 2))
    p = plan(*inputs)
    resolution = resolve(p, found(p, {(3,)}))
    sent = orjson.loads(missing_body({"model": "m", "input": [list(x) for x in inputs]}, resolution))
    assert sent["input"] == [[1, 2]]


def test_a_miss_maps_vllm_indexes_onto_keys_including_duplicates() -> None:
    inputs = ("x", "y", "x")
    p = plan(*inputs)
    resolution = resolve(p, found(p, set()))
    assert resolution.outcome == "miss"
    answer = parse_response(upstream(list(inputs)))
    fresh = upstream_vectors(answer, p.keys)
    assert fresh == {p.keys[0]: vec("x"), p.keys[1]: vec("y")}
    assert len(entries_to_store(fresh)) == 2


def test_a_stored_value_this_code_cannot_read_is_fetched_again() -> None:
    p = plan("a", "b")
    values = found(p, {"a", "b"})
    values[1] = b"?garbage"
    resolution = resolve(p, values)
    assert resolution.outcome == "partial" and resolution.missing == (p.keys[1],)


@pytest.mark.parametrize("data", [
    None,
    [],
    [{"index": 0, "embedding": [1.0]}],  # one short
    [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}],  # repeated
    [{"index": 0, "embedding": [1.0]}, {"index": 2, "embedding": [1.0]}],  # out of range
    [{"index": 0, "embedding": [1.0]}, {"index": True, "embedding": [1.0]}],
    [{"index": 0, "embedding": [1.0]}, {"index": 1}],
    [{"index": 0, "embedding": [1.0]}, "x"],
])
def test_an_answer_that_does_not_match_the_inputs_is_an_error(data: Any) -> None:
    with pytest.raises(MergeError):
        upstream_vectors({"data": data}, ("k1", "k2"))


@pytest.mark.parametrize("body", [b"", b"not json", b"[1]"])
def test_unparseable_answers_are_errors(body: bytes) -> None:
    with pytest.raises(MergeError):
        parse_response(body)


@pytest.mark.parametrize(("usage", "tokens"), [
    ({"prompt_tokens": 5, "total_tokens": 7}, 7), ({"prompt_tokens": 5}, 5), ({}, None),
    ({"total_tokens": -1, "prompt_tokens": True}, None), (None, None),
])
def test_usage_tokens(usage: Any, tokens: int | None) -> None:
    assert usage_tokens({"usage": usage}) == tokens
