"""After a scripted mix of traffic, metrics count exactly what was sent; no secret leaks anywhere."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import usage_of
from tests.harness.redis_fixtures import process_redis
from tests.harness.redis_servers import ProcessRedis

LISTED_KEY = "sk-observability-listed-0123456789"
UNLISTED_KEY = "sk-observability-unlisted-9876543210"
REDIS_PASSWORD = "redis-pass-Zq8rT1x"


def doc() -> dict[str, Any]:
    d = default_doc()
    d["telemetry"] = {"sample": 1}  # every request read and recorded in full (issue 16 samples)
    d["api_keys"] = [{"name": "obs-bot", "tenant": "obs",
                      "sha256": hashlib.sha256(LISTED_KEY.encode()).hexdigest()}]
    d["rate_limits"] = {"tenant": {"overrides": {"tight": {"requests": "2/h"}}}}
    return d


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[ProcessRedis]:
    with process_redis(password=REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory,
       redis_with_password: ProcessRedis) -> Iterator[Gateway]:
    # A generous Redis deadline: this test counts decisions exactly, and a loaded CI machine
    # must not turn a slow Redis answer into an on_backend_error admit.
    env = {"LLM_SIDECAR_REDIS_URL": redis_with_password.url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "2000"}
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-obs")), env=env,
                         capture_logs=True) as gateway:
        yield gateway


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and all((k, v) in sample_labels for k, v in labels.items()))


def test_metrics_count_exactly_what_was_sent(gw: Gateway) -> None:
    listed = openai.OpenAI(base_url=gw.openai_base, api_key=LISTED_KEY, max_retries=0)
    usage_tokens = {"input": 0, "output": 0}
    for i in range(5):
        reply = listed.chat.completions.create(
            model="llama-2-13b", messages=[{"role": "user", "content": f"plain {i}"}],
            max_tokens=3 + i)
        usage_tokens["input"] += usage_of(reply).prompt_tokens
        usage_tokens["output"] += usage_of(reply).completion_tokens
    for i in range(4):
        stream = listed.chat.completions.create(
            model="llama-2-13b", messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=6, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage:
                usage_tokens["input"] += chunk.usage.prompt_tokens
                usage_tokens["output"] += chunk.usage.completion_tokens
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as too_long:
            listed.chat.completions.create(
                model="llama-2-13b", messages=[{"role": "user", "content": "x"}],
                extra_headers={"x-context-length": "99999"})
        assert too_long.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        listed.chat.completions.create(model="llama-2-13b", messages=[])
    tight = openai.OpenAI(base_url=gw.openai_base, api_key=UNLISTED_KEY, max_retries=0,
                          default_headers={"x-tenant-id": "tight"})
    limited = 0
    for _ in range(4):
        try:
            tight.chat.completions.create(
                model="llama-2-13b", messages=[{"role": "user", "content": "t"}], max_tokens=1)
        except openai.RateLimitError:
            limited += 1
    assert limited == 2

    ext = scrape(gw.extproc_metrics)
    assert total(ext, "llm_sidecar_requests_total", model="llama-2-13b", outcome="ok") == 11
    assert total(ext, "llm_sidecar_requests_total", outcome="rate_limited") == 2
    # Envoy resets each ext_proc stream after its last answer: a normal end, not an abort.
    assert total(ext, "llm_sidecar_requests_total", outcome="aborted") == 0
    # One request_done line per routed request, with the same outcome as its metrics.
    lines = [json.loads(line) for line in gw.logs().splitlines() if '"request_done"' in line]
    assert sorted(line["outcome"] for line in lines) == ["ok"] * 11 + ["rate_limited"] * 2
    assert total(ext, "llm_sidecar_requests_total", outcome="rate_limited", tenant="other") == 2
    assert total(ext, "llm_sidecar_rejections_total", status="413",
                 code="context_length_exceeded") == 3
    assert total(ext, "llm_sidecar_rejections_total", status="400") == 1
    assert total(ext, "gen_ai_server_time_to_first_token_seconds_count") == 4
    assert total(ext, "gen_ai_server_time_per_output_token_seconds_count") == 4
    assert total(ext, "gen_ai_server_request_duration_seconds_count") == 13
    # Token sums equal the simulator's usage (the 2 single-token tight requests included).
    assert total(ext, "gen_ai_client_token_usage_sum", token_type="output") == \
        usage_tokens["output"] + 2
    assert total(ext, "gen_ai_client_token_usage_sum", token_type="input", tenant="obs") == \
        usage_tokens["input"]

    rl = scrape(gw.ratelimit_metrics)
    assert total(rl, "ratelimit_decisions_total", level="tenant", kind="requests",
                 result="over_limit") == 2
    assert total(rl, "ratelimit_requests_total", code="over_limit") == 2


def test_no_secret_reaches_logs_metrics_or_redis(gw: Gateway,
                                                 redis_with_password: ProcessRedis) -> None:
    for key in (LISTED_KEY, UNLISTED_KEY):
        client = openai.OpenAI(base_url=gw.openai_base, api_key=key, max_retries=0)
        client.chat.completions.create(
            model="llama-2-13b", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                     "content": "x"}])
        assert key not in str(err.value.body)
    texts = {
        "logs": gw.logs(),
        "extproc metrics": urllib.request.urlopen(f"{gw.extproc_metrics}/metrics").read().decode(),
        "ratelimit metrics": urllib.request.urlopen(
            f"{gw.ratelimit_metrics}/metrics").read().decode(),
    }
    with redis_with_password.client() as redis_client:
        keys = [k.decode() for k in redis_client.keys("*")]
    texts["redis keys"] = "\n".join(keys)
    assert keys, "the rate limiter should have written buckets to Redis"
    assert "request_done" in texts["logs"]
    for where, text in texts.items():
        for secret in (LISTED_KEY, UNLISTED_KEY, REDIS_PASSWORD):
            assert secret not in text, f"{secret[:8]}... leaked into {where}"
