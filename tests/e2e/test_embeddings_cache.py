"""The embedding cache through real Envoy with real Redis (docs: Embedding cache; Headers).

The simulator's journal shows what reached "vLLM"; an uncached model on the same pool gives the
answer every cached one must equal. Stores happen after the answer, so tests wait for them.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sidecar_runtime.process.procs import free_port
from tests.harness.ci import unavailable
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.redis_servers import RedisServer

CACHE = {"namespace": "bge", "ttl": "1h"}
CANARY = {"model": "bge-m3-v2", "cluster": "embed-canary", "percent": 100}


def doc() -> dict[str, Any]:
    d = default_doc()
    d["clusters"]["embed-canary"] = {**d["clusters"]["embed"],
                                     "endpoints": [f"127.0.0.1:{free_port()}"]}
    d["models"] = {
        "llama-2-13b": d["models"]["llama-2-13b"],
        "bge-m3": {"kind": "embedding", "clusters": ["embed"], "cache": CACHE},
        "bge-m3-copy": {"kind": "embedding", "clusters": ["embed"], "cache": CACHE},
        "bge-m3-plain": {"kind": "embedding", "clusters": ["embed"]},
        "bge-m3-canaried": {"kind": "embedding", "clusters": ["embed"], "cache": CACHE,
                            "canary": CANARY},
        "bge-m3-same-weights": {"kind": "embedding", "clusters": ["embed"], "canary": CANARY,
                                "cache": {**CACHE, "share_with_canary": True}},
    }
    d["rate_limits"] = {"tenant": {"overrides": {"thrifty": {"tokens": "100/min"},
                                                 "frugal": {"tokens": "100/min"}}}}
    return d


@pytest.fixture(scope="module")
def redis_url(redis_server_module: RedisServer | None) -> str:
    if redis_server_module is None:
        unavailable("redis")
    return redis_server_module.url


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Gateway]:
    # What is tested here is hit/partial/miss, not the deadline: a loaded test machine must not
    # turn a lookup into a bypass (the deadline has its own test below, on the default 50 ms).
    env = {"LLM_SIDECAR_REDIS_URL": redis_url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-cache")), env=env) as gateway:
        yield gateway


@pytest.fixture
def fresh(gw: Gateway, redis_server: RedisServer) -> RedisServer:
    """A flushed Redis and an empty simulator journal for each test."""
    gw.clear_sims()
    return redis_server


def post(gw: Gateway, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(f"{gw.url}/v1/embeddings", data=json.dumps(body).encode(),
                                     method="POST", headers={"content-type": "application/json",
                                                             **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, \
                json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def embeddings(gw: Gateway, model: str, inputs: Any, **extra: Any) -> tuple[str | None, Any]:
    status, headers, body = post(gw, {"model": model, "input": inputs, **extra})
    assert status == 200, body
    return headers.get("x-llm-cache"), body


def sent_inputs(gw: Gateway, cluster: str = "embed") -> list[Any]:
    """The ``input`` of each request the simulator received, oldest first."""
    return [r["body"]["input"] for r in gw.sim_requests(cluster)]


def wait_stored(server: RedisServer, count: int, timeout_s: float = 5.0) -> None:
    """Until Redis holds at least ``count`` vectors (stores run after the answer is sent)."""
    with server.client() as client:
        deadline = time.monotonic() + timeout_s
        while len(client.keys("llm-sidecar:emb:v1:*")) < count:
            assert time.monotonic() < deadline, "the vectors were never stored"
            time.sleep(0.02)


def vectors(body: Any) -> list[Any]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["embedding"] for d in body["data"]]


def test_miss_then_hit_calls_vllm_once(gw: Gateway, fresh: RedisServer) -> None:
    first = embeddings(gw, "bge-m3", ["alpha", "beta"])
    assert first[0] == "miss"
    wait_stored(fresh, 2)
    second = embeddings(gw, "bge-m3", ["alpha", "beta"])
    assert second[0] == "hit"
    assert vectors(second[1]) == vectors(first[1])
    assert second[1]["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    assert sent_inputs(gw) == [["alpha", "beta"]]  # the simulator saw one call
    with fresh.client() as client:
        key = client.keys("llm-sidecar:emb:v1:bge:*")[0]
        assert 3500_000 < client.pttl(key) <= 3600_000  # ttl: 1h
        assert len(client.get(key)) == 1 + 4 * 256  # float32 bytes, not JSON


def test_partial_hit_sends_only_the_missing_inputs_and_equals_an_uncached_answer(
        gw: Gateway, fresh: RedisServer) -> None:
    embeddings(gw, "bge-m3", ["b", "d"])
    wait_stored(fresh, 2)
    gw.clear_sims()
    inputs = ["a", "b", "c", "d", "e"]
    cache, merged = embeddings(gw, "bge-m3", inputs)
    assert cache == "partial"
    assert sent_inputs(gw) == [["a", "c", "e"]]
    _, plain = embeddings(gw, "bge-m3-plain", inputs)
    assert vectors(merged) == vectors(plain)
    assert merged["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
    wait_stored(fresh, 5)  # the new vectors are stored too
    assert embeddings(gw, "bge-m3", inputs)[0] == "hit"


def test_duplicates_are_sent_once_and_answered_at_every_position(
        gw: Gateway, fresh: RedisServer) -> None:
    embeddings(gw, "bge-m3", ["x"])
    wait_stored(fresh, 1)
    gw.clear_sims()
    inputs = ["y", "x", "y", "z", "x", "y"]
    cache, merged = embeddings(gw, "bge-m3", inputs)
    assert cache == "partial" and sent_inputs(gw) == [["y", "z"]]
    _, plain = embeddings(gw, "bge-m3-plain", inputs)
    assert vectors(merged) == vectors(plain)
    wait_stored(fresh, 3)
    cache, hit = embeddings(gw, "bge-m3", inputs)
    assert cache == "hit" and vectors(hit) == vectors(plain)


def test_token_id_inputs_are_cached_apart_from_text(gw: Gateway, fresh: RedisServer) -> None:
    ids = [[1, 2, 3], [4, 5]]
    assert embeddings(gw, "bge-m3", ids)[0] == "miss"
    wait_stored(fresh, 2)
    assert embeddings(gw, "bge-m3", "1,2,3")[0] == "miss"  # text is not the same input
    cache, body = embeddings(gw, "bge-m3", [4, 5])  # one list of ids = the second input above
    assert cache == "hit"
    assert vectors(body) == vectors(embeddings(gw, "bge-m3-plain", [[4, 5]])[1])


def test_base64_comes_back_as_the_same_strings(gw: Gateway, fresh: RedisServer) -> None:
    inputs = ["p", "q", "r"]
    _, first = embeddings(gw, "bge-m3", inputs[:2], encoding_format="base64")
    wait_stored(fresh, 2)
    cache, merged = embeddings(gw, "bge-m3", inputs, encoding_format="base64")
    assert cache == "partial"
    _, plain = embeddings(gw, "bge-m3-plain", inputs, encoding_format="base64")
    assert vectors(merged) == vectors(plain) and vectors(first) == vectors(plain)[:2]
    floats = struct.unpack("<256f", base64.b64decode(vectors(merged)[0]))
    # float and base64 are different cache entries: a float request is a miss, and equal.
    cache, as_floats = embeddings(gw, "bge-m3", ["p"])
    assert cache == "miss" and vectors(as_floats)[0] == list(floats)


def test_dimensions_are_part_of_the_key(gw: Gateway, fresh: RedisServer) -> None:
    embeddings(gw, "bge-m3", ["dim"], dimensions=32)
    wait_stored(fresh, 1)
    assert embeddings(gw, "bge-m3", ["dim"], dimensions=16)[0] == "miss"
    cache, body = embeddings(gw, "bge-m3", ["dim"], dimensions=32)
    assert cache == "hit" and len(vectors(body)[0]) == 32


def test_a_batch_of_2048_inputs(gw: Gateway, fresh: RedisServer) -> None:
    inputs = [f"document number {i}" for i in range(2048)]
    cache, _ = embeddings(gw, "bge-m3", inputs[:1024])
    assert cache == "miss"
    wait_stored(fresh, 1024)
    cache, merged = embeddings(gw, "bge-m3", inputs)  # ~11 MB of JSON each way
    assert cache == "partial" and sent_inputs(gw)[-1] == inputs[1024:]
    _, plain = embeddings(gw, "bge-m3-plain", inputs)
    assert vectors(merged) == vectors(plain)
    wait_stored(fresh, 2048)
    cache, hit = embeddings(gw, "bge-m3", inputs)
    assert cache == "hit" and vectors(hit) == vectors(plain)


def test_two_models_in_one_namespace_share_vectors(gw: Gateway, fresh: RedisServer) -> None:
    embeddings(gw, "bge-m3", ["shared"])
    wait_stored(fresh, 1)
    cache, body = embeddings(gw, "bge-m3-copy", ["shared"])
    assert cache == "hit" and body["model"] == "bge-m3-copy"
    assert sent_inputs(gw) == [["shared"]]


def test_a_canary_does_not_read_the_stable_vectors_unless_configured(
        gw: Gateway, fresh: RedisServer) -> None:
    embeddings(gw, "bge-m3", ["c1"])
    wait_stored(fresh, 1)
    cache, body = embeddings(gw, "bge-m3-canaried", ["c1"])
    assert cache == "miss" and body["model"] == "bge-m3-v2"
    assert [r["body"]["model"] for r in gw.sim_requests("embed-canary")] == ["bge-m3-v2"]
    wait_stored(fresh, 2)
    with fresh.client() as client:
        assert len(client.keys("llm-sidecar:emb:v1:bge@bge-m3-v2:*")) == 1
    # Opted in (same weights): the canary reads the stable namespace.
    cache, _ = embeddings(gw, "bge-m3-same-weights", ["c1"])
    assert cache == "hit"


def test_the_openai_sdk_gets_identical_results_cached_and_uncached(
        gw: Gateway, fresh: RedisServer) -> None:
    client = openai.OpenAI(base_url=gw.openai_base, api_key="sk-sdk", max_retries=0, timeout=30)
    inputs = ["one", "two", "three", "two"]
    plain = client.embeddings.create(model="bge-m3-plain", input=inputs)  # base64 on the wire
    miss = client.embeddings.with_raw_response.create(model="bge-m3", input=inputs[:2])
    assert miss.headers["x-llm-cache"] == "miss"
    # The SDK accepts gzip; vLLM is asked for plain JSON, which extproc reads and merges.
    assert all(k.lower() != "accept-encoding" for k in gw.sim_requests("embed")[-1]["headers"])
    wait_stored(fresh, 2)
    partial = client.embeddings.with_raw_response.create(model="bge-m3", input=inputs)
    assert partial.headers["x-llm-cache"] == "partial"
    wait_stored(fresh, 3)
    hit = client.embeddings.with_raw_response.create(model="bge-m3", input=inputs)
    assert hit.headers["x-llm-cache"] == "hit"
    expected = [d.embedding for d in plain.data]
    for raw in (partial, hit):
        assert [d.embedding for d in raw.parse().data] == expected
        assert [d.index for d in raw.parse().data] == [0, 1, 2, 3]
    floats = client.embeddings.create(model="bge-m3", input=inputs, encoding_format="float")
    assert [d.embedding for d in floats.data] == expected


def test_hits_reserve_no_tokens_misses_reserve_their_inputs(
        gw: Gateway, fresh: RedisServer) -> None:
    text = "word " * 150  # ~190 tokens: more than a 100/min bucket holds
    embeddings(gw, "bge-m3", [text])
    wait_stored(fresh, 1)
    for _ in range(5):  # hits: they cost a request each, and no tokens
        status, headers, _ = post(gw, {"model": "bge-m3", "input": [text]}, **{
            "x-tenant-id": "frugal"})
        assert status == 200 and headers["x-llm-cache"] == "hit"
    status, _, _ = post(gw, {"model": "bge-m3-plain", "input": ["small"]}, **{
        "x-tenant-id": "frugal"})
    assert status == 200  # the token bucket is untouched
    # A miss reserves its counted input: ~190 tokens can never fit a 100-token bucket.
    status, _, body = post(gw, {"model": "bge-m3", "input": [text + "!"]}, **{
        "x-tenant-id": "thrifty"})
    assert status == 429 and body["error"]["type"] == "tokens"
    assert "can ever hold (100)" in body["error"]["message"]
    # One of ~65 fits; it is settled to what vLLM used, and a second no longer fits.
    half = "word " * 50
    status, headers, _ = post(gw, {"model": "bge-m3", "input": [half]}, **{
        "x-tenant-id": "thrifty"})
    assert status == 200 and headers["x-llm-cache"] == "miss"
    status, _, body = post(gw, {"model": "bge-m3", "input": [half + "!"]}, **{
        "x-tenant-id": "thrifty"})
    assert status == 429 and body["error"]["type"] == "tokens"


def test_metrics_count_lookups_by_result(gw: Gateway, fresh: RedisServer) -> None:
    def count(result: str) -> float:
        with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        line = f'llm_sidecar_cache_lookups_total{{result="{result}"}} '
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    before = {r: count(r) for r in ("hit", "partial", "miss")}
    embeddings(gw, "bge-m3", ["m1"])
    wait_stored(fresh, 1)
    embeddings(gw, "bge-m3", ["m1"])
    embeddings(gw, "bge-m3", ["m1", "m2"])
    assert {r: count(r) - before[r] for r in before} == {"hit": 1, "partial": 1, "miss": 1}


def test_two_extproc_processes_share_one_redis(gw: Gateway, fresh: RedisServer,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    other_doc = default_doc()
    other_doc["models"]["bge-m3"]["cache"] = CACHE
    env = {"LLM_SIDECAR_REDIS_URL": fresh.url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}
    with running_gateway(other_doc, str(tmp_path_factory.mktemp("gw-cache-2")), env=env) as other:
        assert embeddings(other, "bge-m3", ["from the other"])[0] == "miss"
        wait_stored(fresh, 1)
        cache, body = embeddings(gw, "bge-m3", ["from the other", "mine"])
        assert cache == "partial" and sent_inputs(gw) == [["mine"]]
        wait_stored(fresh, 2)
        cache, _ = embeddings(other, "bge-m3", ["mine"])
        assert cache == "hit"
        assert len(other.sim_requests("embed")) == 1
        _, plain = embeddings(gw, "bge-m3-plain", ["from the other", "mine"])
        assert vectors(body) == vectors(plain)


def test_redis_killed_mid_run_is_a_bypass_never_an_error(
        own_redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = default_doc()
    d["models"]["bge-m3"]["cache"] = CACHE
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-cache-kill")),
                         env={"LLM_SIDECAR_REDIS_URL": own_redis_server.url,
                              "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}) as gw:
        embeddings(gw, "bge-m3", ["k1"])
        wait_stored(own_redis_server, 1)
        assert embeddings(gw, "bge-m3", ["k1"])[0] == "hit"
        own_redis_server.kill()
        for _ in range(10):
            cache, body = embeddings(gw, "bge-m3", ["k1", "k2"])
            assert cache == "bypass" and len(body["data"]) == 2
        own_redis_server.restart()  # empty; the breaker lets a probe through after its cooldown
        deadline = time.monotonic() + 10
        while (cache := embeddings(gw, "bge-m3", ["k1"])[0]) == "bypass":
            assert time.monotonic() < deadline, "the cache never came back"
            time.sleep(0.1)
        assert cache == "miss"
        with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        bypass = next(x for x in text.splitlines()
                      if x.startswith('llm_sidecar_cache_lookups_total{result="bypass"}'))
        assert float(bypass.split()[-1]) >= 10


def test_without_redis_the_memory_backend_caches(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = default_doc()
    d["models"]["bge-m3"]["cache"] = CACHE
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-cache-mem"))) as gw:
        assert embeddings(gw, "bge-m3", ["mem"])[0] == "miss"
        deadline = time.monotonic() + 5
        while (cache := embeddings(gw, "bge-m3", ["mem"])[0]) != "hit":
            assert cache == "miss" and time.monotonic() < deadline
            time.sleep(0.02)


def test_an_upstream_error_passes_through_and_its_body_skips_extproc(
        gw: Gateway, fresh: RedisServer) -> None:
    def response_bodies_seen() -> float:
        with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        prefix = 'llm_sidecar_extproc_message_seconds_count{phase="response_body"} '
        return float(next((x for x in text.splitlines() if x.startswith(prefix)), "0 0").split()[-1])

    before = response_bodies_seen()
    embeddings(gw, "bge-m3", ["ok"])
    assert response_bodies_seen() > before  # a 200's body does come through extproc
    wait_stored(fresh, 1)
    before = response_bodies_seen()
    status, headers, body = post(gw, {"model": "bge-m3", "input": ["e"], "dimensions": 100000})
    assert status == 400 and headers["x-llm-cache"] == "miss"
    assert "dimensions" in body["error"]["message"]  # the simulator's own error, untouched
    # Envoy honoured the mode override sent with the response headers: no body message came.
    assert response_bodies_seen() == before
    time.sleep(0.2)
    with fresh.client() as client:
        assert len(client.keys("llm-sidecar:emb:v1:*")) == 1  # nothing stored for the error
