"""Cache hits are requests (docs: Rate limits): through real Envoy and the real rate-limit service, on
its memory backend and on real Redis, an embeddings request answered wholly from the cache costs
1 from its request buckets and gets the same 429 a miss gets; a dead rate limiter gets the
failure policy Envoy's filter has, and no hit waits for it."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.redis_fixtures import process_redis

BURST = 20
KEY = "sk-cache-hit-limits-0123456789"


def doc(**services: Any) -> dict[str, Any]:
    d = default_doc()
    d["models"]["bge-m3"]["cache"] = {"namespace": "bge", "ttl": "1h"}
    d["api_keys"] = [{"name": "hit-bot", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]
    # 1 an hour: nothing refills while the test runs, so every request shows in the bucket.
    d["rate_limits"] = {"api_key": {"default": {"requests": "1/h", "burst": BURST}}}
    d["services"].update(services)
    return d


@pytest.fixture(scope="module", params=["memory", "redis"])
def gw(request: pytest.FixtureRequest,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = str(tmp_path_factory.mktemp(f"gw-hits-{request.param}"))
    if request.param == "memory":
        with running_gateway(doc(), workdir) as gateway:
            yield gateway
        return
    with process_redis() as redis:
        env = {"LLM_SIDECAR_REDIS_URL": redis.url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "2000"}
        with running_gateway(doc(), workdir, env=env) as gateway:
            yield gateway


def post(gw: Gateway, inputs: list[str], key: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "bge-m3", "input": inputs}).encode()
    request = urllib.request.Request(
        f"{gw.url}/v1/embeddings", data=body, method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def cache_inputs(gw: Gateway, inputs: list[str]) -> None:
    """Store ``inputs``, from other keys (a fresh one per request: no bucket runs dry)."""
    def other_key() -> str:
        return f"sk-cacher-{time.monotonic_ns()}"

    assert post(gw, inputs, other_key())[0] == 200
    deadline = time.monotonic() + 10
    while post(gw, inputs, other_key())[1].get("x-llm-cache") != "hit":
        assert time.monotonic() < deadline, "the vectors were never stored"
        time.sleep(0.05)


def same_error(hit: bytes, miss: bytes) -> None:
    """Equal bodies, but for the seconds to wait, which count down between the two requests."""
    def normal(body: bytes) -> Any:
        doc = json.loads(body)
        doc["error"]["message"] = re.sub(r"\d+ seconds?", "N seconds", doc["error"]["message"])
        return doc
    assert normal(hit) == normal(miss)


def test_hits_cost_a_request_each_and_get_the_429_a_miss_gets(gw: Gateway) -> None:
    key = f"sk-hits-{time.monotonic_ns()}"  # an unlisted key: a fresh api_key bucket
    cache_inputs(gw, ["alpha", "beta"])
    answers = [post(gw, ["alpha", "beta"], key) for _ in range(BURST + 5)]
    statuses = [status for status, _, _ in answers]
    assert statuses == [200] * BURST + [429] * 5
    assert all(headers.get("x-llm-cache") == "hit" for _, headers, _ in answers[:BURST])
    assert [int(h["x-ratelimit-remaining-requests"]) for _, h, _ in answers[:3]] == [19, 18, 17]
    # The IETF header shows the rate (1 an hour) as its limit, and never more remaining.
    assert {h["x-ratelimit-remaining"] for _, h, _ in answers[:3]} == {"1"}
    _, hit_headers, hit_body = answers[-1]
    status, miss_headers, miss_body = post(gw, ["never cached"], key)  # a miss, same key
    assert status == 429
    same_error(hit_body, miss_body)
    error = json.loads(hit_body)["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    for name in ("content-type", "x-ratelimit-limit", "x-ratelimit-remaining"):
        assert hit_headers[name] == miss_headers[name], name
    assert int(hit_headers["retry-after"]) >= 1 and int(hit_headers["x-ratelimit-reset"]) >= 1
    assert "x-llm-cache" not in hit_headers  # a refused hit serves nothing


def test_spoofed_routing_headers_do_not_move_a_hit_to_another_bucket(gw: Gateway) -> None:
    key = f"sk-spoof-{time.monotonic_ns()}"
    cache_inputs(gw, ["gamma"])
    for _ in range(BURST):
        assert post(gw, ["gamma"], key)[0] == 200
    body = json.dumps({"model": "bge-m3", "input": ["gamma"]}).encode()
    request = urllib.request.Request(
        f"{gw.url}/v1/embeddings", data=body, method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {key}",
                 "x-llm-key-id": "k-someone-else", "x-llm-model": "other"})
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(request, timeout=60)
    assert denied.value.code == 429


@pytest.mark.parametrize(("deny", "status"), [(False, 200), (True, 503)])
def test_with_the_rate_limiter_down_a_hit_gets_envoys_failure_policy(
        tmp_path: Any, deny: bool, status: int) -> None:
    answers = {}
    with running_gateway(doc(ratelimit_failure_mode_deny=deny, ratelimit_timeout_s=1.0),
                         str(tmp_path)) as gw:
        cache_inputs(gw, ["delta"])
        ratelimit = gw.child("ratelimit")
        # Hung (accepts connections, never answers: the deadline decides), then dead.
        ratelimit.process.send_signal(signal.SIGSTOP)
        try:
            answers["hung"] = post(gw, ["delta"], KEY), post(gw, ["not cached"], KEY)
        finally:
            ratelimit.process.send_signal(signal.SIGCONT)
        ratelimit.stop()
        answers["dead"] = post(gw, ["delta"], KEY), post(gw, ["not cached"], KEY)
    for fault, (hit, miss) in answers.items():
        assert (hit[0], miss[0]) == (status, status), fault
        if deny:
            for _, _, body in (hit, miss):
                error = json.loads(body)["error"]
                assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
        else:
            assert hit[1]["x-llm-cache"] == "hit"
