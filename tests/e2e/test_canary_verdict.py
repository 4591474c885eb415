"""The canary verdict end to end (issue 38; docs: Canary verdict): openai SDK → real Envoy →
extproc, which replays a share of stable answers on the canary as shadows, compares each pair
and judges the canary → simulated vLLM pools.

Three models share one stable pool; their canaries run on pools of their own: ``same`` answers
as stable does, ``drift`` changes most words of every answer (the simulator's ``drift``), and
``slow`` answers the same words after a long prefill.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sidecar_runtime.process.procs import free_port
from tests.harness.gateway import Gateway, ip, running_gateway
from tests.harness.waits import wait_for

PAIRS = 12
COMPARE = {"shadow_percent": 100, "min_samples": PAIRS, "max_shadows_per_s": 1000,
           "max_in_flight": 16}


def pool(**simulate: Any) -> dict[str, Any]:
    return {"endpoints": [ip(free_port())], "max_context": 8192,
            "simulate": {"decode_ms_per_token": 0.5, **simulate}}


def doc() -> dict[str, Any]:
    return {
        "version": 1,
        "envoy": {"listen": ip(free_port()), "admin": ip(free_port())},
        "services": {"extproc": ip(free_port()), "ratelimit": ip(free_port()),
                     "ratelimit_timeout_s": 2.0},
        "clusters": {"stable": pool(), "canary-same": pool(), "canary-drift": pool(drift=0.8),
                     "canary-slow": pool(prefill_ms_per_token=20)},
        "models": {
            "same": {"clusters": ["stable"], "canary": {
                "model": "same-v2", "cluster": "canary-same", "percent": 0,
                "compare": COMPARE}},
            "drift": {"clusters": ["stable"], "canary": {
                "model": "drift-v2", "cluster": "canary-drift", "percent": 50,
                "compare": {**COMPARE, "action": "rollback"}}},
            "slow": {"clusters": ["stable"], "canary": {
                "model": "slow-v2", "cluster": "canary-slow", "percent": 0,
                "compare": {**COMPARE, "action": "report"}}},
        },
        "rate_limits": {"api_key": {"default": {"requests": "1000/min"}}},
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("verdict"))) as gw:
        yield gw


def client(gateway: Gateway, key: str = "sk-client-secret") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.openai_base, api_key=key, max_retries=0, timeout=30)


def stream(c: openai.OpenAI, model: str, text: str) -> tuple[str, str]:
    """Stream one chat; (its text, the pool that served it)."""
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=24, stream=True)
    parts = [chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices]
    return "".join(parts), raw.headers["x-sim-name"]


def metrics(gateway: Gateway) -> str:
    with urllib.request.urlopen(f"{gateway.extproc_metrics}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def gauge(gateway: Gateway, name: str, **labels: str) -> float | None:
    for line in metrics(gateway).splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def verdict(gateway: Gateway, model: str) -> str | None:
    for name in ("promote", "hold", "rollback"):
        if gauge(gateway, "llm_sidecar_canary_verdict", model=model, verdict=name) == 1:
            return name
    return None


def pairs(gateway: Gateway, model: str) -> float:
    return gauge(gateway, "llm_sidecar_canary_shadows_total", model=model,
                 result="compared") or 0.0


def journal(gateway: Gateway, cluster: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{gateway.sims[cluster]}/sim/requests", timeout=5) as resp:
        entries: list[dict[str, Any]] = json.loads(resp.read())
    return [e for e in entries if e["path"] == "/v1/chat/completions"]


def canary_page(gateway: Gateway) -> str:
    with urllib.request.urlopen(f"{gateway.extproc_metrics}/canary", timeout=5) as resp:
        return str(resp.read().decode())


def test_a_canary_that_answers_the_same_is_promoted_with_rouge_near_one(
        gateway: Gateway) -> None:
    c = client(gateway)
    for i in range(PAIRS + 2):
        stream(c, "same", f"question number {i} about the quarterly report")
    wait_for(lambda: pairs(gateway, "same") >= PAIRS, timeout=30, what="the shadow pairs")
    assert verdict(gateway, "same") in ("promote", "hold")
    rouge = gauge(gateway, "llm_sidecar_canary_rouge_l", model="same")
    assert rouge is not None and rouge > 0.99
    page = canary_page(gateway)
    assert "canary verdict for same:" in page and "shadow pairs" in page


def test_shadows_reach_the_canary_without_credentials_and_cost_the_client_nothing(
        gateway: Gateway) -> None:
    c = client(gateway, "sk-shadowed-key")
    remaining = []
    for i in range(4):
        raw = c.chat.completions.with_raw_response.create(
            model="same", messages=[{"role": "user", "content": f"budget {i}"}], max_tokens=4)
        remaining.append(int(raw.headers["x-ratelimit-remaining"]))
    # Four requests, four charged: the shadows behind them are charged to nobody.
    assert remaining == [999, 998, 997, 996]
    wait_for(lambda: len([e for e in journal(gateway, "canary-same")
                          if "budget 3" in json.dumps(e["body"])]) == 1,
             timeout=20, what="the shadow of the last request to reach the canary")
    shadows = [e for e in journal(gateway, "canary-same") if "budget" in json.dumps(e["body"])]
    assert len(shadows) == 4
    for entry in shadows:
        headers = entry["headers"]
        assert not {"authorization", "x-api-key", "cookie"} & set(headers)
        assert not any(name.startswith("x-llm-") for name in headers)
        assert entry["body"]["model"] == "same-v2" and entry["body"]["stream"] is True


def test_a_drifting_canary_is_rolled_back_and_its_keys_go_to_stable(gateway: Gateway) -> None:
    keys = [f"sk-drift-{i}" for i in range(12)]
    served = {k: stream(client(gateway, k), "drift", "hello")[1] for k in keys}
    on_canary = [k for k, pool_name in served.items() if pool_name == "canary-drift"]
    on_stable = [k for k, pool_name in served.items() if pool_name == "stable"]
    assert on_canary and on_stable, served
    c = client(gateway, on_stable[0])  # stable requests are the ones shadowed
    for i in range(PAIRS + 2):
        stream(c, "drift", f"drift question {i}")
    wait_for(lambda: verdict(gateway, "drift") == "rollback", timeout=30,
             what="the drifting canary's rollback")
    rouge = gauge(gateway, "llm_sidecar_canary_rouge_l", model="drift")
    assert rouge is not None and rouge < 0.5
    assert gauge(gateway, "llm_sidecar_canary_guard_tripped", model="drift") == 1
    # The keys the draw had put on the canary are now served by stable.
    for key in on_canary:
        assert stream(client(gateway, key), "drift", "after")[1] == "stable"


def test_a_slower_canary_is_judged_on_its_latency(gateway: Gateway) -> None:
    c = client(gateway)
    for i in range(PAIRS + 2):
        stream(c, "slow", f"slow question {i} " + "with a prompt of some length " * 4)
    wait_for(lambda: pairs(gateway, "slow") >= PAIRS, timeout=60, what="the shadow pairs")
    assert verdict(gateway, "slow") == "rollback"  # action report: judged, not stopped
    page = canary_page(gateway)
    block = page[page.index("canary verdict for slow"):]
    ratio = re.search(r"TTFT P99 \(s\).*ratio (\S+)", block)
    assert ratio is not None and float(ratio.group(1)) > 1.2, block
    assert "TTFT P99 ratio" in block
    # Report only: the canary still serves its share.
    assert stream(client(gateway, "sk-anyone"), "slow", "still here")[0]
