"""Streams where Envoy has no usage filters (``telemetry.envoy_usage: false``, as behind an Istio
EnvoyFilter), through real Envoy: extproc reads every stream a limit settles, asks vLLM for the
usage chunk a client did not ask for, settles with it, and takes it out of the client's stream
itself. The pool sends four tokens a chunk (vLLM's ``--stream-interval``), so a settlement that
counted chunks would charge a quarter of the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.chaos.support import metric
from tests.e2e.test_envoy_usage import MESSAGES, raw_stream
from tests.harness import charges
from tests.harness.gateway import Gateway, default_doc, running_gateway

pytestmark = pytest.mark.e2e

DAY_CAP = 100_000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = default_doc()
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 0.2, "stream_interval": 4}
    d["telemetry"] = {"sample": 0, "envoy_usage": False}
    d["rate_limits"] = {"tenant": {"overrides": {
        name: {"tokens": f"{DAY_CAP}/d"} for name in ("plain", "asked", "probe")}}}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-stream-usage"))) as gateway:
        yield gateway


def charged_by(gw: Gateway, tenant: str, send: Any) -> tuple[int, int, int]:
    probe = openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                          timeout=30, default_headers={"x-tenant-id": tenant})
    return charges.charged_by(
        probe.chat.completions.with_raw_response.create,
        lambda: metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens"),
        send, DAY_CAP)


def prompt_tokens(gw: Gateway) -> int:
    """The simulator's count of ``MESSAGES`` (vLLM's, as the usage chunk says it)."""
    answer = openai.OpenAI(base_url=gw.openai_base, api_key="sk-probe", max_retries=0,
                           timeout=30, default_headers={"x-tenant-id": "probe"}
                           ).chat.completions.create(model="llama-2-13b", messages=MESSAGES,
                                                     max_tokens=1)
    assert answer.usage is not None
    return answer.usage.prompt_tokens


@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_usage": None},
                                     {"include_usage": False, "continuous_usage_stats": True}])
def test_a_stream_without_usage_is_settled_from_vllms_usage_and_sees_none(
        gw: Gateway, options: dict[str, Any] | None) -> None:
    prompt = prompt_tokens(gw)

    def send() -> int:
        body: dict[str, Any] = {"model": "llama-2-13b", "messages": MESSAGES, "max_tokens": 40}
        if options is not None:
            body["stream_options"] = options
        chunks = raw_stream(gw, "plain", body)
        assert all(c["choices"] and not c.get("usage") for c in chunks), chunks
        assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) == 10
        return 40 + prompt

    lost, total, refill = charged_by(gw, "plain", send)
    assert total - refill <= lost <= total


@pytest.mark.parametrize("options", [{"include_usage": True}, {},
                                     {"continuous_usage_stats": True}])
def test_a_client_that_asked_for_usage_gets_it(gw: Gateway, options: dict[str, Any]) -> None:
    """As vLLM reads ``stream_options``: ``include_usage`` is true unless it says otherwise."""
    def send() -> int:
        chunks = raw_stream(gw, "asked", {"model": "llama-2-13b", "messages": MESSAGES,
                                          "max_tokens": 40, "stream_options": options})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40
        if options.get("continuous_usage_stats"):
            assert all("usage" in c for c in chunks)
        return int(chunks[-1]["usage"]["total_tokens"])

    lost, total, refill = charged_by(gw, "asked", send)
    assert total - refill <= lost <= total
