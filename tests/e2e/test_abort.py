"""Aborted requests through real Envoy: a client that hangs up mid-stream, or while an embeddings
request is upstream, still leaves one ``request_done`` line (outcome ``aborted``) and its metrics,
with the tokens streamed before the hang-up counted."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.test_observability import scrape, total
from tests.harness.gateway import Gateway, default_doc, running_gateway

DEADLINE_S = 30.0


def doc() -> dict[str, Any]:
    d = default_doc()
    d["telemetry"] = {"sample": 1}  # every request read and recorded in full (issue 16 samples)
    # Slow enough that a response is surely still going when the client hangs up: 200 tokens
    # at 50 ms take 10 s; one embedding input of ~60 tokens at 1 s per token takes a minute.
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 50}
    d["clusters"]["embed"]["simulate"] = {"prefill_ms_per_token": 1000}
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-abort")),
                         capture_logs=True) as gateway:
        yield gateway


def request_lines(gw: Gateway) -> list[dict[str, Any]]:
    out = []
    for line in gw.logs().splitlines():
        if '"request_done"' in line:
            record = json.loads(line)
            if record.get("event") == "request_done":
                out.append(record)
    return out


def wait_for(what: str, condition: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_stream_the_client_drops_is_recorded_as_aborted_with_its_tokens(gw: Gateway) -> None:
    body = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "abort me"}],
            "max_tokens": 200, "stream": True}
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    read = 0  # content tokens, not the first chunk (the role) or the usage chunk
    while read < 3:
        line = response.readline()
        assert line, "the stream ended before three tokens"
        if line.startswith(b"data: {"):
            choices = json.loads(line[len(b"data: "):])["choices"]
            read += bool(choices and choices[0]["delta"].get("content"))
    response.close()  # hang up mid-stream
    conn.close()
    aborted = wait_for("the aborted request's line", lambda: [
        r for r in request_lines(gw) if r["model"] == "llama-2-13b"])
    (line,) = aborted
    assert line["outcome"] == "aborted" and line["status"] == 200 and line["streamed"]
    assert 3 <= line["completion_tokens"] < 200  # what was streamed before the hang-up
    assert line["charged_tokens"] is None
    metrics = scrape(gw.extproc_metrics)
    assert total(metrics, "llm_sidecar_requests_total", model="llama-2-13b") == 1
    assert total(metrics, "llm_sidecar_requests_total", model="llama-2-13b",
                 outcome="aborted") == 1
    assert total(metrics, "gen_ai_client_token_usage_sum", model="llama-2-13b",
                 token_type="output") == line["completion_tokens"]
    assert total(metrics, "gen_ai_client_token_usage_sum", model="llama-2-13b",
                 token_type="input") == line["prompt_tokens"] > 0


def test_an_embeddings_request_dropped_while_upstream_is_recorded_as_aborted(
        gw: Gateway) -> None:
    gw.clear_sims()
    text = " ".join(f"word{i}" for i in range(40))
    payload = json.dumps({"model": "bge-m3", "input": [text]}).encode()
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: gw\r\n"
                     b"content-type: application/json\r\n"
                     + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for("the request to reach the pool", lambda: gw.sim_requests("embed"))
    # The socket is closed: Envoy resets the upstream request and the ext_proc stream.
    (line,) = wait_for("the aborted embeddings line", lambda: [
        r for r in request_lines(gw) if r["model"] == "bge-m3"])
    assert line["outcome"] == "aborted" and line["status"] == 0
    assert line["prompt_tokens"] > 0 and line["charged_tokens"] is None
    metrics = scrape(gw.extproc_metrics)
    assert total(metrics, "llm_sidecar_requests_total", model="bge-m3", outcome="aborted") == 1
