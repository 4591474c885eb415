"""A quiet gateway is measured in full (issue 35): with the default ``telemetry`` (a 1 % share
and ``sample_min_per_s: 5``), five streams on a fresh ``llm-sidecar up`` are all in the TTFT,
time-per-token and token histograms, not only in the request count."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import urllib.request

import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sidecar_runtime.process.procs import envoy_binary, free_port
from tests.harness.ci import unavailable
from tests.harness.gateway import default_doc


def counts(metrics_url: str) -> dict[str, float]:
    """Each histogram's ``_count`` (and the request counter) for llama-2-13b, summed."""
    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != "llama-2-13b":
                continue
            if sample.name.endswith("_count") or sample.name == "llm_sidecar_requests_total":
                key = sample.name
                if "token_type" in sample.labels:
                    key += ":" + sample.labels["token_type"]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def test_five_streams_on_a_fresh_up_are_all_in_the_ttft_histogram(tmp_path: pathlib.Path) -> None:
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    doc = default_doc()
    assert "telemetry" not in doc  # the defaults a new user gets
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(doc))
    metrics_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_sidecar", "up", "--config", str(config),
         "--extproc-metrics-port", str(metrics_port),
         "--ratelimit-metrics-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "llm-sidecar is up: http://" in line, line
        client = openai.OpenAI(base_url=line.split("up: ", 1)[1].split()[0], api_key="k",
                               max_retries=0, timeout=10)
        for i in range(5):
            stream = client.chat.completions.create(
                model="llama-2-13b", messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=4, stream=True)
            assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content
                       ) >= 2
        # Each stream was recorded before its last chunk left extproc, so before the client
        # had it: nothing to wait for.
        seen = counts(f"http://127.0.0.1:{metrics_port}")
        assert seen["llm_sidecar_requests_total"] == 5
        assert seen["gen_ai_server_time_to_first_token_seconds_count"] == 5
        assert seen["gen_ai_server_time_per_output_token_seconds_count"] == 5
        assert seen["gen_ai_client_token_usage_count:output"] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
