"""Pools of other engines through the whole gateway (issue 35): the simulator streams in the
engine's own chunk shape (``simulate: {engine: ...}``, :func:`simulator.sse.engine_event`), and a
client that did not ask for usage receives the engine's events without the usage event extproc
added; one that asked gets it once; the settle is the engine's usage.

llama.cpp's key order (``"choices":[]`` then ``"created"``) leaked the usage event to clients
before the strip read events; SGLang's ``usage: null`` on every chunk must not confuse it.
``telemetry.sample: 0`` and ``sample_min_per_s: 0``: Envoy, not extproc, reads every stream's
usage, so the strip is what every stream goes through.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.chaos.support import metric, wait_until
from tests.harness import charges
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import user

pytestmark = pytest.mark.e2e

MESSAGES = user("hi")
DAY_CAP = 100_000
TENANTS = ("plain", "asked", "probe")


@pytest.fixture(scope="module", params=["llamacpp", "sglang"])
def gw(request: pytest.FixtureRequest,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = default_doc()
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 5,
                                               "engine": request.param}
    d["telemetry"] = {"sample": 0, "sample_min_per_s": 0, "envoy_usage": True}
    d["rate_limits"] = {"tenant": {"overrides": {
        name: {"tokens": f"{DAY_CAP}/d"} for name in TENANTS}}}
    with running_gateway(d, str(tmp_path_factory.mktemp(f"gw-{request.param}"))) as gateway:
        yield gateway


def _client(gw: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                         timeout=30, default_headers={"x-tenant-id": tenant})


def _settled(gw: Gateway) -> float:
    return metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens")


def _raw(gw: Gateway, tenant: str, options: dict[str, Any] | None) -> str:
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body: dict[str, Any] = {"model": "llama-2-13b", "messages": MESSAGES, "max_tokens": 12,
                            "stream": True}
    if options is not None:
        body["stream_options"] = options
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"authorization": f"Bearer sk-{tenant}", "x-tenant-id": tenant,
                  "content-type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    return raw


def _chunks(raw: str) -> list[dict[str, Any]]:
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", raw
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_client_that_did_not_ask_gets_no_usage_event_and_the_engines_usage_is_settled(
        gw: Gateway) -> None:
    settles = _settled(gw)
    probe = _client(gw, "probe").chat.completions.create(
        model="llama-2-13b", messages=MESSAGES, max_tokens=1)
    assert probe.usage is not None
    wait_until(lambda: _settled(gw) >= settles + 1, 10, 0.05)

    def send() -> int:
        chunks = _chunks(_raw(gw, "plain", None))
        assert all(c["choices"] for c in chunks), chunks  # no usage event
        assert not any(c.get("usage") for c in chunks), chunks
        content = sum(1 for c in chunks if c["choices"][0]["delta"].get("content"))
        assert content == 12
        return content + probe.usage.prompt_tokens  # type: ignore[union-attr]

    lost, total, refill = charges.charged_by(
        _client(gw, "plain").chat.completions.with_raw_response.create,
        lambda: _settled(gw), send, DAY_CAP)
    assert total - refill <= lost <= total


def test_a_client_that_asked_gets_the_usage_event_once_in_the_engines_shape(
        gw: Gateway) -> None:
    raw = _raw(gw, "asked", {"include_usage": True})
    usage_events = [c for c in _chunks(raw) if not c["choices"]]
    assert len(usage_events) == 1, raw
    assert usage_events[0]["usage"]["completion_tokens"] == 12
    first = raw.split("\n\n", 1)[0]
    if '"system_fingerprint":"b1-sim"' in raw:  # llama.cpp's order: choices first
        assert first.startswith('data: {"choices":'), first
    else:  # SGLang's: usage null on every content chunk
        assert '"usage":null' in first, first
