"""Security guarantees, tried the way an attacker would, through real Envoy.

- HTTP/2 (h2c) requests sent frame by frame: no request reaches a pool, or a sidecar service,
  without extproc's decision, whatever headers, body or trailers it carries.
- No client credential reaches a pool; a pool with ``upstream_api_key_env`` gets its own key.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.h2c import h2_request

CHAT = json.dumps({"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 1}).encode()
SIDECARS = ("llm-sidecar-ratelimit", "llm-sidecar-extproc")


POOL_KEY_ENV = "LLM_SIDECAR_TEST_POOL_KEY"
POOL_KEY = "sk-vllm-short-own-key"


def doc() -> dict[str, Any]:
    d = default_doc()
    d["rate_limits"] = {"api_key": {"default": {"requests": "1000/s"}}}
    d["clusters"]["vllm-short"]["upstream_api_key_env"] = POOL_KEY_ENV
    d["models"]["bge-m3"]["cache"] = {"namespace": "bge-private", "scope": "tenant"}
    d["models"]["bge-shared"] = {"kind": "embedding", "clusters": ["embed"],
                                 "cache": {"namespace": "bge-shared"}}
    d["models"]["llama-private"] = {"clusters": ["vllm-short"], "prefix_cache_scope": "tenant"}
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-security")),
                         env={POOL_KEY_ENV: POOL_KEY}) as gateway:
        yield gateway


def fingerprint(value: str) -> str:
    """What the simulator's journal keeps of a credential header (simulator/journal.py)."""
    return "redacted sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


def listen(gw: Gateway) -> str:
    return gw.url.removeprefix("http://")


def chat_headers(**extra: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":authority", "llm"),
            (":path", "/v1/chat/completions"), ("content-type", "application/json"),
            ("authorization", "Bearer sk-h2-attacker"), *extra.items()]


def served(gw: Gateway) -> dict[str, int]:
    return {name: len(gw.sim_requests(name)) for name in gw.sims}


@pytest.mark.parametrize("target", ["vllm-long", *SIDECARS])
def test_h2_headers_then_trailers_only_is_decided_by_extproc(gw: Gateway, target: str) -> None:
    """HEADERS without END_STREAM, then trailers only: extproc never gets a body message, yet
    the request is answered by it (400), not routed on the client's x-llm-cluster."""
    gw.clear_sims()
    resp = h2_request(listen(gw), chat_headers(**{"x-llm-cluster": target, "x-llm-tenant": "x"}),
                      trailers=[("x-llm-cluster", target), ("x-trailer", "1")])
    assert resp.status == 400, (resp.status, resp.body)
    error = json.loads(resp.body)["error"]
    assert error["code"] == "invalid_json"
    assert served(gw) == {name: 0 for name in gw.sims}


@pytest.mark.parametrize("target", ["vllm-long", *SIDECARS])
def test_h2_headers_alone_never_reach_a_pool(gw: Gateway, target: str) -> None:
    gw.clear_sims()
    resp = h2_request(listen(gw), chat_headers(**{"x-llm-cluster": target}))
    assert resp.status == 400, (resp.status, resp.body)
    assert served(gw) == {name: 0 for name in gw.sims}


@pytest.mark.parametrize("target", ["vllm-long", *SIDECARS])
def test_h2_body_and_trailers_go_where_extproc_decides(gw: Gateway, target: str) -> None:
    """A real request sent with trailers is still decided and limited: a short prompt goes to
    the short pool whatever x-llm-cluster the client sent, with the rate limiter's headers."""
    gw.clear_sims()
    resp = h2_request(listen(gw), chat_headers(**{"x-llm-cluster": target}), body=CHAT,
                      trailers=[("x-llm-cluster", target)])
    assert resp.status == 200, (resp.status, resp.body)
    assert resp.headers["x-sim-name"] == "vllm-short"
    assert resp.headers["x-ratelimit-limit"].startswith("1000")
    [seen] = gw.sim_requests("vllm-short")
    assert seen["headers"]["x-llm-cluster"] == "vllm-short"
    assert served(gw)["vllm-long"] == 0


def test_h2_body_without_trailers_is_routed(gw: Gateway) -> None:
    gw.clear_sims()
    resp = h2_request(listen(gw), chat_headers(), body=CHAT)
    assert resp.status == 200, (resp.status, resp.body)
    assert resp.headers["x-sim-name"] == "vllm-short"


def post(gw: Gateway, path: str, doc: dict[str, Any], **headers: str) -> dict[str, str]:
    request = urllib.request.Request(f"{gw.url}{path}", data=json.dumps(doc).encode(),
                                     headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200
        return dict(resp.headers)


CLIENT = {"authorization": "Bearer sk-client-secret", "x-api-key": "sk-client-other",
          # other SDKs' and proxies' credential headers:
          "api-key": "sk-azure", "x-goog-api-key": "sk-goog", "proxy-authorization": "Basic eA==",
          "cookie": "session=s3cret",
          # "_" for "-": a server reading one as the other would see a credential or a routing
          # header extproc never set
          "x_api_key": "sk-under", "x_llm_tenant": "legal"}


def test_client_credentials_never_reach_a_pool_and_a_pool_gets_its_own_key(gw: Gateway) -> None:
    gw.clear_sims()
    chat = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    post(gw, "/v1/chat/completions", chat, **CLIENT)  # the short pool: has its own key
    post(gw, "/v1/chat/completions", chat, **CLIENT, **{"x-context-length": "4000"})  # long
    post(gw, "/v1/embeddings", {"model": "bge-m3", "input": ["hello"]}, **CLIENT)
    h2 = h2_request(listen(gw), [*chat_headers(), ("x-api-key", "sk-client-other")],
                    body=CHAT)
    assert h2.status == 200
    [short, short_h2] = gw.sim_requests("vllm-short")
    [long] = gw.sim_requests("vllm-long")
    [embed] = gw.sim_requests("embed")
    for seen in (short, short_h2):
        assert seen["headers"]["authorization"] == fingerprint(f"Bearer {POOL_KEY}")
    for seen in (long, embed):
        assert "authorization" not in seen["headers"]
    for seen in (short, short_h2, long, embed):
        assert not ({"x-api-key", *CLIENT} - {"authorization"}) & set(seen["headers"])
        assert seen["headers"]["x-llm-key-id"] != "anonymous"  # the key was read, then removed


def guarded_canary_doc() -> dict[str, Any]:
    d = default_doc()
    d["models"]["llama-2-13b"]["canary"] = {
        "model": "llama-2-13b-v2", "cluster": "vllm-canary", "percent": 50, "sticky": "api_key",
        "guard": {"min_samples": 5}}
    # Three requests per key, then 429s from the gateway's own rate limiter.
    d["rate_limits"] = {"api_key": {"default": {"requests": "3/h"}}}
    return d


def status_of(gw: Gateway, key: str, **extra: Any) -> tuple[int, str]:
    body = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, **extra}
    request = urllib.request.Request(f"{gw.url}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json",
                                              "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers["x-sim-name"]
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("x-sim-name", "")


def test_429s_and_bad_requests_of_clients_never_stop_the_canary(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with running_gateway(guarded_canary_doc(), str(tmp_path_factory.mktemp("gw-guard"))) as gw:
        pools: dict[str, list[str]] = {"vllm-short": [], "vllm-canary": []}
        i = 0
        while min(len(keys) for keys in pools.values()) < 8:
            key = f"sk-guard-{i}"
            i += 1
            status, pool = status_of(gw, key)
            assert status == 200
            pools[pool].append(key)
        # Each canary key: a request vLLM refuses (min_tokens above max_tokens), then a flood
        # of 429s from the rate limiter: 8 OK, 8 x 400, 8 x 1 OK, 8 x 10 x 429 on the canary.
        for key in pools["vllm-canary"]:
            assert status_of(gw, key, min_tokens=2) == (400, "vllm-canary")
            assert status_of(gw, key) == (200, "vllm-canary")
            assert {status_of(gw, key)[0] for _ in range(10)} == {429}
        metrics = urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5).read()
        assert b"llm_sidecar_canary_guard_tripped{" not in metrics
        # Still on: a fresh key that hashes to the canary is served by it.
        served = {status_of(gw, f"sk-guard-after-{j}")[1] for j in range(16)}
        assert "vllm-canary" in served


def test_a_client_request_id_is_kept_for_tracing_but_never_used_as_the_id(gw: Gateway) -> None:
    """Envoy's own HCM keeps a client's x-request-id (use_remote_address off, or a client on a
    private network): `sticky: request` would let the client pick its canary variant. The id
    Envoy generates is the request's id; the client's travels on as x-client-request-id."""
    gw.clear_sims()
    chat = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    chosen = "client-chosen-id-0001"
    answered = post(gw, "/v1/chat/completions", chat, **{"x-request-id": chosen})
    bare = post(gw, "/v1/chat/completions", chat)
    [seen, seen_bare] = gw.sim_requests("vllm-short")
    assert answered["x-request-id"] != chosen and len(answered["x-request-id"]) >= 32
    assert seen["headers"]["x-request-id"] == answered["x-request-id"]
    assert seen["headers"]["x-client-request-id"] == chosen
    assert "x-client-request-id" not in seen_bare["headers"]
    assert seen_bare["headers"]["x-request-id"] == bare["x-request-id"]


def cache_says(gw: Gateway, model: str, text: str, tenant: str) -> str:
    return post(gw, "/v1/embeddings", {"model": model, "input": [text]},
                **{"x-tenant-id": tenant})["x-llm-cache"]


def test_a_tenant_scoped_cache_tells_no_tenant_what_another_embedded(gw: Gateway) -> None:
    """scope: tenant: tenant B's miss on what A embedded (no oracle); shared: B's hit."""
    assert cache_says(gw, "bge-m3", "merger plan for ACME", "legal") == "miss"
    assert cache_says(gw, "bge-m3", "merger plan for ACME", "legal") == "hit"
    assert cache_says(gw, "bge-m3", "merger plan for ACME", "sales") == "miss"
    assert cache_says(gw, "bge-shared", "merger plan for ACME", "legal") == "miss"
    assert cache_says(gw, "bge-shared", "merger plan for ACME", "sales") == "hit"


DOCUMENT = " ".join(f"clause {i}: the parties agree to item {i * 7}." for i in range(60))
"""~2,900 bytes: ~720 tokens by the simulator's estimate, 45 of its 16-token KV blocks."""


def prefix_hits(gw: Gateway) -> float:
    """vLLM's ``vllm:prefix_cache_hits`` of the short pool: prompt tokens served from cache."""
    text = urllib.request.urlopen(f"{gw.sims['vllm-short']}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def cached_by(gw: Gateway, model: str, tenant: str, **extra: Any) -> float:
    """Prompt tokens vLLM found cached for ``tenant``'s request of DOCUMENT (its prefill skips
    them: the answer comes that much sooner, which is what a timing attacker measures)."""
    before = prefix_hits(gw)
    post(gw, "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": DOCUMENT}], "max_tokens": 1,
          **extra}, **{"x-tenant-id": tenant})
    return prefix_hits(gw) - before


def test_a_tenant_prefix_cache_reuses_no_other_tenants_prompt(gw: Gateway) -> None:
    """prefix_cache_scope: tenant: B's prompt finds none of the blocks A's identical prompt left
    in vLLM, whatever cache_salt B sends (even A's as vLLM got it, to this model or to a shared
    model on the same pool: vLLM's block hash does not cover the model); A's repeat finds them
    all. shared (the default): B's finds A's, the timing side channel."""
    gw.clear_sims()
    assert cached_by(gw, "llama-private", "legal") == 0
    assert cached_by(gw, "llama-private", "legal") > 600
    assert cached_by(gw, "llama-private", "sales") == 0
    [first, *_] = gw.sim_requests("vllm-short")
    legal_salt = first["body"]["cache_salt"]
    assert cached_by(gw, "llama-private", "sales", cache_salt=legal_salt) == 0
    assert cached_by(gw, "llama-2-13b", "sales", cache_salt=legal_salt) == 0
    # Unsalted: nothing of the salted prompts serves it, then the pod's cache is everyone's.
    assert cached_by(gw, "llama-2-13b", "legal") == 0
    assert cached_by(gw, "llama-2-13b", "sales") > 600
    shared = [r["body"] for r in gw.sim_requests("vllm-short") if r["body"]["model"] == "llama-2-13b"]
    assert shared[0]["cache_salt"] not in (legal_salt, None)
    assert ["cache_salt" in body for body in shared] == [True, False, False]
