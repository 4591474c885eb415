"""What render puts in Envoy, seen working: pool health checks, /healthz and draining, request ids."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar_runtime.process.procs import free_port
from tests.harness.gateway import Gateway, default_doc, running_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    doc = default_doc()
    live = doc["clusters"]["vllm-long"]["endpoints"][0]
    # A pool of two pods, one of them down: the simulator of vllm-long, and a port nobody serves.
    doc["clusters"]["vllm-pair"] = {"endpoints": [live, f"127.0.0.1:{free_port()}"],
                                    "max_context": 32768}
    doc["models"]["llama-2-13b"]["clusters"] = ["vllm-short", "vllm-pair"]
    with running_gateway(doc, str(tmp_path_factory.mktemp("gw-render"))) as gateway:
        yield gateway


def get(url: str, method: str = "GET", body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def chat() -> bytes:
    return json.dumps({"model": "llama-2-13b", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def hosts(gw: Gateway, cluster: str) -> list[dict[str, Any]]:
    _, _, body = get(f"{gw.admin_url}/clusters?format=json")
    status = next(c for c in json.loads(body)["cluster_statuses"] if c["name"] == cluster)
    found: list[dict[str, Any]] = status["host_statuses"]
    return found


def test_active_health_checks_keep_requests_off_a_dead_pod(gw: Gateway) -> None:
    deadline = time.monotonic() + 10
    while True:
        health = {h["address"]["socket_address"]["port_value"]: h["health_status"]
                  for h in hosts(gw, "vllm-pair")}
        failed = [p for p, s in health.items() if s.get("failed_active_health_check")]
        if failed:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert len(failed) == 1 and len(health) == 2
    for _ in range(20):
        status, headers, body = get(f"{gw.openai_base}/chat/completions", "POST", chat(),
                                    {"x-context-length": "4000"})  # to the pair
        assert status == 200, body
        assert headers["x-sim-name"] == "vllm-long"


def test_healthz_is_answered_by_envoy_and_fails_while_draining(gw: Gateway) -> None:
    assert get(f"{gw.url}/healthz")[0] == 200
    assert get(f"{gw.admin_url}/healthcheck/fail", "POST")[0] == 200
    try:
        assert get(f"{gw.url}/healthz")[0] == 503
        status, _, _ = get(f"{gw.openai_base}/chat/completions", "POST", chat())
        assert status == 200  # requests in flight or still arriving are served while draining
    finally:
        assert get(f"{gw.admin_url}/healthcheck/ok", "POST")[0] == 200
    assert get(f"{gw.url}/healthz")[0] == 200


def test_the_request_id_is_returned_to_the_client(gw: Gateway) -> None:
    status, headers, _ = get(f"{gw.openai_base}/chat/completions", "POST", chat())
    assert status == 200
    assert len(headers["x-request-id"]) >= 32


def test_a_32k_token_prompt_passes_envoys_buffers(gw: Gateway) -> None:
    def send(words: int) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"model": "llama-2-13b", "max_tokens": 4, "messages": [
            {"role": "user", "content": "abcdefgh " * words}]}).encode()
        return get(f"{gw.openai_base}/chat/completions", "POST", body)

    status, headers, body = send(10_000)  # 90 KB: ~30K tokens by extproc's (high) estimate
    assert status == 200, body[:300]
    assert headers["x-sim-name"] == "vllm-long"
    status, _, body = send(15_000)  # 135 KB: reaches extproc whole, which finds it too long
    assert status == 413
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"


def test_a_body_above_max_request_bytes_is_a_json_413(gw: Gateway) -> None:
    body = b'{"model": "llama-2-13b", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    status, headers, reply = get(f"{gw.openai_base}/completions", "POST", body)
    assert status == 413
    assert headers["content-type"] == "application/json"
    assert json.loads(reply)["error"]["code"] == "request_too_large"
