"""Limits a reload adds where the gateway started with none, through real Envoy: enforced at
once. Envoy reads its bootstrap once; with ``rate_limits:`` present it carries the actions of
every (kind, level), so a request, token or concurrency limit added at a level that had none
binds without ``render`` and a restart (it used to be accepted and never enforced)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import yaml

from tests.chaos.support import metric, wait_until
from tests.e2e.test_reload import RELOAD_INTERVAL_S, change
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body, user

pytestmark = pytest.mark.e2e


def start_doc() -> dict[str, Any]:
    doc = default_doc()
    doc["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 20}
    doc["rate_limits"] = {"api_key": {"default": {"requests": "10000/s"}}}
    return doc


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_SIDECAR_RELOAD_INTERVAL_S", RELOAD_INTERVAL_S)
        with running_gateway(start_doc(), str(tmp_path_factory.mktemp("gw-reload-limits")),
                             capture_logs=True) as gateway:
            change(gateway, limited_doc(gateway))
            yield gateway


def limited_doc(gw: Gateway) -> dict[str, Any]:
    """The running file (its ports) with the tenant limits added."""
    with open(gw.config_path, encoding="utf-8") as handle:
        doc: dict[str, Any] = yaml.safe_load(handle)
    doc["rate_limits"]["tenant"] = {"overrides": {
        "counted": {"requests": "2/h"}, "metered": {"tokens": "50/h"},
        "single": {"concurrent": 1}}}
    return doc


def bootstrap_stale(gw: Gateway) -> float:
    return metric(gw.extproc_metrics, "extproc_envoy_bootstrap_stale")


def test_an_edit_only_a_restart_applies_is_reported_and_a_reloaded_limit_is_not(
        gw: Gateway) -> None:
    """The limits added above reload live: Envoy's bootstrap is still the one the file renders.
    A new endpoint is not: every request then says so (gauge, one warning), and nothing fails."""
    chat(gw, "anyone")
    assert bootstrap_stale(gw) == 0
    running = limited_doc(gw)
    doc = yaml.safe_load(yaml.safe_dump(running))
    doc["clusters"]["vllm-long"]["endpoints"].append("127.0.0.1:9")
    change(gw, doc)
    try:
        chat(gw, "anyone")
        assert bootstrap_stale(gw) == 1
        assert "envoy_bootstrap_stale" in gw.logs()
    finally:
        change(gw, running)


def client(gw: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                         timeout=30, default_headers={"x-tenant-id": tenant})


def chat(gw: Gateway, tenant: str, max_tokens: int = 1) -> None:
    client(gw, tenant).chat.completions.create(model="llama-2-13b", messages=user("hi"),
                                               max_tokens=max_tokens)


def test_a_request_limit_added_by_reload_binds(gw: Gateway) -> None:
    chat(gw, "counted")
    chat(gw, "counted")
    with pytest.raises(openai.RateLimitError) as caught:
        chat(gw, "counted")
    assert error_body(caught.value)["type"] == "requests"


def test_a_token_limit_added_by_reload_binds(gw: Gateway) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        chat(gw, "metered", max_tokens=100)  # reserves ~117 of a 50-token bucket
    assert error_body(caught.value)["type"] == "tokens"


def test_a_concurrency_cap_added_by_reload_binds_and_frees_its_slot(gw: Gateway) -> None:
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "llama-2-13b", "messages": user("hi"), "max_tokens": 100, "stream": True}),
        {"authorization": "Bearer sk-single", "x-tenant-id": "single",
         "content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline()  # streaming: its slot is held
    with pytest.raises(openai.RateLimitError) as caught:
        chat(gw, "single")
    assert error_body(caught.value)["type"] == "concurrent"
    response.read()
    conn.close()

    def admitted() -> bool:
        try:
            chat(gw, "single")
        except openai.RateLimitError:
            return False
        return True
    wait_until(admitted, 10, 0.1)  # the stream-done call freed the slot
