"""``simulate: {speed, kv_cache_tokens}`` reach the pods ``llm-sidecar up`` starts, and the
pods' prefix-cache counters move with traffic sent through Envoy."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionSystemMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.gateway import default_doc, running_gateway


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body.decode()


def _counter(metrics_url: str, name: str) -> float:
    for family in text_string_to_metric_families(_get(metrics_url)):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")


def test_up_passes_speed_and_kv_cache_to_the_simulators(tmp_path: Path) -> None:
    doc: dict[str, Any] = default_doc()
    doc["clusters"]["vllm-short"]["simulate"] = {
        "decode_ms_per_token": 0.2, "speed": 2.0, "kv_cache_tokens": 4096,
    }
    with running_gateway(doc, str(tmp_path / "gw")) as gw:
        state = json.loads(_get(gw.sims["vllm-short"] + "/sim/state"))
        assert state["settings"]["speed"] == 2.0
        assert state["settings"]["kv_capacity_tokens"] == 4096
        other = json.loads(_get(gw.sims["vllm-long"] + "/sim/state"))
        assert (other["settings"]["speed"], other["settings"]["kv_capacity_tokens"]) == (1.0, 8 * 32768)

        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0, timeout=10)
        system: ChatCompletionSystemMessageParam = {
            "role": "system", "content": "You review supply contracts for a legal team. " * 20}
        for question in ("Who pays for shipping?", "When can either party terminate?"):
            client.chat.completions.create(
                model="llama-2-13b", max_tokens=2,
                messages=[system, {"role": "user", "content": question}],
            )
        metrics = gw.sims["vllm-short"] + "/metrics"
        assert _counter(metrics, "vllm:prefix_cache_hits_total") >= 224  # the system prompt's blocks
        assert _counter(metrics, "vllm:prefix_cache_queries_total") > _counter(
            metrics, "vllm:prefix_cache_hits_total"
        )
