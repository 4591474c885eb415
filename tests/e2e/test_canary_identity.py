"""Canary share and stickiness, identity and header hygiene, through real Envoy."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body, user

LISTED_KEY = "sk-listed-legal"
CHAT = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1}
"""The request the raw-HTTP clients send; ``say_hi`` sends the same through the ``openai`` client."""


def say_hi(client: openai.OpenAI) -> ChatCompletion:
    return client.chat.completions.create(model="llama-2-13b", messages=user("hi"), max_tokens=1)


def doc() -> dict[str, Any]:
    d = default_doc()
    d["models"]["llama-2-13b"]["canary"] = {"model": "llama-2-13b-v2", "cluster": "vllm-canary",
                                            "percent": 5, "sticky": "api_key"}
    d["api_keys"] = [{"name": "legal-bot", "tenant": "legal",
                      "sha256": hashlib.sha256(LISTED_KEY.encode()).hexdigest()}]
    d["rate_limits"] = {"tenant": {"overrides": {"vip": {"requests": "1/h"}}}}
    d["priority"] = {"high_below": 500, "low_from": 5000, "inject": True}
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-canary"))) as gateway:
        yield gateway


async def pools_for(url: str, keys: list[str], concurrency: int = 32) -> list[str]:
    """The simulator that served one chat request per key."""
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(key: str) -> str:
            async with limit, session.post(f"{url}/v1/chat/completions", json=CHAT,
                                           headers={"authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers["x-sim-name"]
        return await asyncio.gather(*(one(k) for k in keys))


def test_five_percent_of_keys_land_on_the_canary(gw: Gateway) -> None:
    pools = asyncio.run(pools_for(gw.url, [f"sk-share-{i}" for i in range(4000)]))
    counts = Counter(pools)
    assert set(counts) == {"vllm-short", "vllm-canary"}
    share = counts["vllm-canary"] / len(pools)
    assert 0.038 <= share <= 0.062, share


def test_one_key_always_gets_one_variant(gw: Gateway) -> None:
    keys = [f"sk-sticky-{i}" for i in range(200)]
    pools = asyncio.run(pools_for(gw.url, keys))
    canary_keys = [k for k, p in zip(keys, pools, strict=True) if p == "vllm-canary"]
    assert canary_keys, "200 keys should put some on a 5% canary"
    for key in (canary_keys[0], "sk-sticky-stable-probe"):
        assert len(set(asyncio.run(pools_for(gw.url, [key] * 20)))) == 1


def test_canary_upstream_gets_the_canary_model_and_stable_never_does(gw: Gateway) -> None:
    gw.clear_sims()
    asyncio.run(pools_for(gw.url, [f"sk-model-{i}" for i in range(300)]))
    canary_seen = gw.sim_requests("vllm-canary")
    stable_seen = gw.sim_requests("vllm-short")
    assert canary_seen and stable_seen
    assert {r["body"]["model"] for r in canary_seen} == {"llama-2-13b-v2"}
    assert {r["body"]["model"] for r in stable_seen} == {"llama-2-13b"}
    assert {r["headers"]["x-llm-variant"] for r in canary_seen} == {"canary"}
    # The rewritten body kept a correct length: vLLM parsed it (status 200 above), and the
    # priority field was injected for vLLM's priority scheduling.
    assert all(r["body"]["priority"] in (0, 1, 2) for r in canary_seen + stable_seen)


def test_spoofed_llm_headers_change_nothing(gw: Gateway) -> None:
    gw.clear_sims()
    spoof = {"x-llm-cluster": "vllm-long", "x-llm-tenant": "vip", "x-llm-key-id": "admin",
             "x-llm-variant": "canary", "x-llm-priority": "high", "x-llm-model": "bge-m3",
             "x-llm-context-length": "1"}
    client = openai.OpenAI(base_url=gw.openai_base, api_key="sk-spoofer", max_retries=0,
                           default_headers=spoof)
    for _ in range(3):  # the vip tenant allows 1 request an hour: spoofing it would 429
        raw = client.chat.completions.with_raw_response.create(
            model="llama-2-13b", messages=[{"role": "user", "content": "x " * 1500}],
            max_tokens=5000)
        assert raw.headers["x-sim-name"] == "vllm-long"  # routed by the real context length
    seen = gw.sim_requests("vllm-long")
    assert len(seen) == 3
    for request in seen:
        headers = request["headers"]
        assert headers["x-llm-tenant"] == "default"
        assert headers["x-llm-key-id"].startswith("u") and headers["x-llm-key-id"] != "admin"
        assert headers["x-llm-variant"] == "stable"
        assert headers["x-llm-priority"] == "low"
        assert headers["x-llm-model"] == "llama-2-13b"
        assert int(headers["x-llm-context-length"]) > 5000


def test_listed_key_maps_to_its_tenant_and_unlisted_to_the_header(gw: Gateway) -> None:
    gw.clear_sims()
    say_hi(openai.OpenAI(base_url=gw.openai_base, api_key=LISTED_KEY, max_retries=0,
                         default_headers={"x-tenant-id": "spoofed"}))
    say_hi(openai.OpenAI(base_url=gw.openai_base, api_key="sk-open", max_retries=0,
                         default_headers={"x-tenant-id": "acme"}))
    tenants = [r["headers"]["x-llm-tenant"] for c in ("vllm-short", "vllm-canary")
               for r in gw.sim_requests(c)]
    assert sorted(tenants) == ["acme", "legal"]
    for cluster in ("vllm-short", "vllm-canary"):
        for request in gw.sim_requests(cluster):
            assert LISTED_KEY not in str(request["headers"].get("x-llm-key-id"))


def test_required_auth(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = doc()
    d["auth"] = {"required": True}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-auth"))) as gateway:
        with pytest.raises(openai.AuthenticationError) as caught:
            say_hi(openai.OpenAI(base_url=gateway.openai_base, api_key="sk-unknown",
                                 max_retries=0))
        assert error_body(caught.value)["code"] == "invalid_api_key"
        no_key = urllib.request.Request(f"{gateway.url}/v1/chat/completions",
                                        data=json.dumps(CHAT).encode(), method="POST",
                                        headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(no_key, timeout=10)
        assert missing.value.code == 401
        assert json.loads(missing.value.read())["error"]["code"] == "invalid_api_key"
        assert all(gateway.sim_requests(c) == [] for c in gateway.sims)
        reply = say_hi(openai.OpenAI(base_url=gateway.openai_base, api_key=LISTED_KEY,
                                     max_retries=0))
        assert reply.choices
        served = [r for c in gateway.sims for r in gateway.sim_requests(c)]
        assert [r["headers"]["x-llm-tenant"] for r in served] == ["legal"]


def slow_canary_doc() -> dict[str, Any]:
    d = default_doc()
    # A canary first token some 200-400 ms late: one stall of the loaded test machine on a
    # stable request (p99 of ~35 samples is about their slowest) must not hide it.
    d["clusters"]["vllm-canary"]["simulate"] = {"prefill_ms_per_token": 10.0,
                                                "decode_ms_per_token": 0.2}
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 0.2}
    d["models"]["llama-2-13b"]["canary"] = {
        "model": "llama-2-13b-v2", "cluster": "vllm-canary", "percent": 50, "sticky": "request",
        "guard": {"min_samples": 20, "max_ttft_p99_ratio": 1.5}}
    return d


def stream_once(gw: Gateway, i: int) -> str:
    raw = openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-slow-{i}", max_retries=0) \
        .chat.completions.with_raw_response.create(
            model="llama-2-13b", messages=[{"role": "user", "content": "tell me " * 10}],
            max_tokens=3, stream=True)
    pool = raw.headers["x-sim-name"]
    for _ in raw.parse():
        pass
    return pool


def test_slow_canary_is_reported_worse_and_the_guard_stops_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with running_gateway(slow_canary_doc(), str(tmp_path_factory.mktemp("gw-slow"))) as gw:
        pools = [stream_once(gw, i) for i in range(70)]
        assert pools.count("vllm-canary") >= 20
        page = urllib.request.urlopen(f"{gw.extproc_metrics}/canary?min_samples=20",
                                      timeout=5).read().decode()
        ttft_rows = [line for line in page.splitlines() if line.startswith("TTFT")]
        assert ttft_rows and all(line.endswith("worse") for line in ttft_rows), page
        metrics = urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5).read()
        assert b'llm_sidecar_canary_guard_tripped{model="llama-2-13b"} 1.0' in metrics
        # Tripped: every later request goes to stable.
        assert {stream_once(gw, 1000 + i) for i in range(20)} == {"vllm-short"}
        # The CLI prints the same comparison.
        import subprocess
        import sys
        out = subprocess.run([sys.executable, "-m", "llm_sidecar", "canary", "--metrics",
                              f"{gw.extproc_metrics}/metrics", "--min-samples", "20"],
                             capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert "canary vs stable for llama-2-13b" in out and "worse" in out
