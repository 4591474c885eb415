"""parse_pod: each engine's /metrics, written the way its own exporter writes it, read with no
configuration; ``endpoint_picker.metrics`` for any other engine; the picker avoids a busy pod of
every engine."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from extproc.picker.engines import Dialect, parse_pod
from extproc.picker.parse import MetricsError, label_values
from extproc.picker.pick import EndpointPicker
from extproc.picker.scrape import PoolPlan, Scraper
from extproc.picker.state import PodMetrics, PoolState
from routing.schema import RoutingConfig

_SG = 'engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"'

# SGLang (python/sglang/srt/metrics/collector.py) through prometheus_client's multiprocess
# collector: labels sorted (so ``le`` sits mid-set), floats as ``12.0`` and ``8.128902e+06``,
# ``_sum`` before the buckets, a ``_created`` per counter, one series per data-parallel rank.
SGLANG = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{dp_rank="0",{_SG}}} 12.0
sglang:num_running_reqs{{dp_rank="1",{_SG}}} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{dp_rank="0",{_SG}}} 4.0
sglang:num_queue_reqs{{dp_rank="1",{_SG}}} 0.0
# HELP sglang:num_grammar_queue_reqs The number of requests in the grammar waiting queue.
# TYPE sglang:num_grammar_queue_reqs gauge
sglang:num_grammar_queue_reqs{{dp_rank="0",{_SG}}} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{dp_rank="0",{_SG}}} 0.61
sglang:token_usage{{dp_rank="1",{_SG}}} 0.28
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{dp_rank="0",{_SG}}} 8.128902e+06
# HELP sglang:prompt_tokens_created Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_created gauge
sglang:prompt_tokens_created{{dp_rank="0",{_SG}}} 1.7496e+09
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{dp_rank="0",{_SG}}} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{{dp_rank="0",engine_type="unified",le="0.001",\
model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"}} 0.0
sglang:time_to_first_token_seconds_bucket{{dp_rank="0",engine_type="unified",le="+Inf",\
model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"}} 5000.0
sglang:time_to_first_token_seconds_count{{dp_rank="0",{_SG}}} 5000.0
"""

# TGI (router/src) through the Rust metrics-exporter-prometheus: ``# TYPE`` lines only, a blank
# line after each family, integers without ``.0``, summaries with ``NaN`` quantiles. No KV gauge.
TGI = """\
# TYPE tgi_request_count counter
tgi_request_count 1234

# TYPE tgi_queue_size gauge
tgi_queue_size 17

# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32

# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 48123

# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 3
tgi_request_duration_bucket{le="+Inf"} 1234
tgi_request_duration_sum 1843.25
tgi_request_duration_count 1234

# TYPE tgi_batch_inference_duration summary
tgi_batch_inference_duration{method="decode",quantile="0"} 0.012
tgi_batch_inference_duration{method="decode",quantile="0.99"} NaN
tgi_batch_inference_duration_sum{method="decode"} 88.5
tgi_batch_inference_duration_count{method="decode"} 4000

"""

# llama.cpp's server (tools/server/server.cpp, handle_metrics): the text written by hand, numbers
# through a C++ stream (``1.23457e+06``), no labels. Current builds have no KV gauge.
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1.23457e+06
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 235.743
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 3.5
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""
# Older builds also wrote the KV cache's use.
LLAMACPP_OLD = LLAMACPP + """\
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.0546875
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 448
"""

_ENSEMBLE = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")

# Triton with the TensorRT-LLM backend (its README's metrics section; Triton core's
# docs/user_guide/metrics.md) through prometheus-cpp: labels sorted, ``Nan`` as it spells it.
TRTLLM = (
    "# HELP nv_inference_pending_request_count Instantaneous number of pending requests "
    "awaiting execution per-model.\n# TYPE nv_inference_pending_request_count gauge\n"
    + "".join(f'nv_inference_pending_request_count{{model="{m}",version="1"}} '
              f'{1 if m == "preprocessing" else 0}\n' for m in _ENSEMBLE)
    + """\
# HELP nv_gpu_power_usage GPU power usage in watts
# TYPE nv_gpu_power_usage gauge
nv_gpu_power_usage{gpu_uuid="GPU-4a3b"} Nan
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 6
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 4
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 7
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.4875
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 3042
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 3198
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 6240
""")
# An older backend: no ``waiting`` request type and no ``fraction`` block type.
TRTLLM_OLD = "\n".join(line for line in TRTLLM.splitlines()
                       if 'request_type="waiting"' not in line
                       and 'kv_cache_block_type="fraction"' not in line) + "\n"


@pytest.mark.parametrize(("text", "expected"), [
    (SGLANG, PodMetrics(waiting=4, running=21, kv_usage=0.61)),
    (TGI, PodMetrics(waiting=17, running=32, kv_usage=None)),
    (LLAMACPP, PodMetrics(waiting=2, running=4, kv_usage=None)),
    (LLAMACPP_OLD, PodMetrics(waiting=2, running=4, kv_usage=0.0546875)),
    (TRTLLM, PodMetrics(waiting=7, running=7, kv_usage=0.4875)),
    (TRTLLM_OLD, PodMetrics(waiting=1, running=7, kv_usage=3042 / 6240)),
    # Any valid spelling: Windows line ends, a timestamp, labels in another order and spaced.
    (SGLANG.replace("\n", "\r\n"), PodMetrics(waiting=4, running=21, kv_usage=0.61)),
    ("tgi_queue_size 3 1712345678000\n\ntgi_batch_current_size 1.0e+00 1712345678000\n",
     PodMetrics(waiting=3, running=1, kv_usage=None)),
    ('nv_trt_llm_request_metrics{version="1", request_type="active", model="m",} 2\n'
     'nv_trt_llm_request_metrics{request_type="waiting",model="m",version="1"} 5\n'
     'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="a"} 0.25\n'
     'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="b"} 0.75\n',
     PodMetrics(waiting=5, running=2, kv_usage=0.75)),
], ids=["sglang", "tgi", "llamacpp", "llamacpp-old", "trtllm", "trtllm-old", "crlf", "timestamps",
        "label-order"])
def test_each_engine_is_read_with_no_configuration(text: str, expected: PodMetrics) -> None:
    assert parse_pod(text) == expected


@pytest.mark.parametrize("text", [SGLANG, TGI, LLAMACPP, LLAMACPP_OLD, TRTLLM, TRTLLM_OLD])
def test_the_fixtures_are_valid_and_read_as_prometheus_client_reads_them(text: str) -> None:
    """The reference parser accepts each body and sums the same samples."""
    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("request_type", "")
            key = (sample.name, kind)
            sums[key] = sums.get(key, 0.0) + sample.value
    parsed = parse_pod(text)
    running = sum(v for (name, kind), v in sums.items() if (name, kind) in {
        ("sglang:num_running_reqs", ""), ("tgi_batch_current_size", ""),
        ("llamacpp:requests_processing", ""), ("nv_trt_llm_request_metrics", "active")})
    assert parsed.running == running


def test_the_vllm_path_is_untouched() -> None:
    body = ("vllm:num_requests_running 4\nvllm:num_requests_waiting 2\n"
            "vllm:kv_cache_usage_perc 0.5\nsglang:num_running_reqs 99\n")
    assert parse_pod(body) == PodMetrics(waiting=2, running=4, kv_usage=0.5)


@pytest.mark.parametrize(("text", "message"), [
    ("", "no engine's load metrics (none of vllm:num_requests_running, sglang:num_running_reqs, "
         "tgi_batch_current_size, llamacpp:requests_processing, "
         'nv_trt_llm_request_metrics{request_type="active"}); name them in endpoint_picker.metrics'),
    ("<html>502</html>", "no engine's load metrics"),
    ("sglang:num_running_reqs_total 3\n", "no engine's load metrics"),
    ("sglang:num_running_reqs 3\n", "not sglang metrics: no sglang:num_queue_reqs"),
    ("tgi_batch_current_size 1\ntgi_queue_size -1\n", "tgi_queue_size is -1: not a finite count"),
    ("llamacpp:requests_processing NaN\n", "is NaN: not a finite count"),
    ('nv_trt_llm_request_metrics{request_type="active"} 1\n',
     'not trtllm metrics: no nv_trt_llm_request_metrics{request_type="waiting"} or '
     "nv_inference_pending_request_count"),
    ('nv_trt_llm_request_metrics{request_type="active} 1\n', "unclosed label value"),
], ids=["empty", "html", "longer-name", "sglang-no-queue", "negative", "nan", "trt-no-queue",
        "bad-labels"])
def test_a_body_that_is_no_engines_is_a_failed_scrape(text: str, message: str) -> None:
    with pytest.raises(MetricsError) as caught:
        parse_pod(text)
    assert message in str(caught.value)


@pytest.mark.parametrize(("labels", "expected"), [
    ('', {}),
    ('a="1",b="2"', {"a": "1", "b": "2"}),
    ('b="2", a = "1",', {"a": "1", "b": "2"}),
    ('x="a,b=c}",y="q\\"t\\\\\\n"', {"x": "a,b=c}", "y": 'q"t\\\n'}),
])
def test_label_values_table(labels: str, expected: dict[str, str]) -> None:
    assert label_values(labels) == expected


# -- endpoint_picker.metrics ----------------------------------------------------------------

CUSTOM = """\
# TYPE myengine_queue gauge
myengine_queue{shard="0"} 3
myengine_queue{shard="1"} 4
myengine_busy 2
myengine_kv{shard="0"} 0.5
myengine_kv{shard="1"} 0.9
"""


def routing(metrics: dict[str, Any] | None = None) -> RoutingConfig:
    picker: dict[str, Any] = {} if metrics is None else {"metrics": metrics}
    return RoutingConfig.model_validate({
        "version": 1, "models": {"m": {"clusters": ["pool"]}},
        "clusters": {"pool": {"endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"],
                              "max_context": 4096, "endpoint_picker": picker}}})


def test_configured_names_read_any_other_engine() -> None:
    plan = PoolPlan.of("pool", routing(
        {"queue": "myengine_queue", "running": "myengine_busy", "kv_cache": "myengine_kv"})
        .clusters["pool"])
    assert plan is not None and plan.dialect is not None
    assert parse_pod(CUSTOM, plan.dialect) == PodMetrics(waiting=7, running=2, kv_usage=0.9)
    with pytest.raises(MetricsError, match="no engine's load metrics"):
        parse_pod(CUSTOM)  # unconfigured, the names mean nothing
    queue_only = Dialect.named("myengine_queue", None, None)
    assert parse_pod(CUSTOM, queue_only) == PodMetrics(waiting=7, running=0, kv_usage=None)
    with pytest.raises(MetricsError, match="not configured metrics: no myengine_gone"):
        parse_pod(CUSTOM, Dialect.named("myengine_queue", None, "myengine_gone"))
    unset = PoolPlan.of("pool", routing().clusters["pool"])
    assert unset is not None and unset.dialect is None


@pytest.mark.parametrize(("metrics", "field"), [
    ({"queue": "my engine"}, "queue"),
    ({"queue": "9lives"}, "queue"),
    ({"queue": "q", "kv_cache": 'kv{a="b"}'}, "kv_cache"),
    ({"running": "r"}, "queue"),
    ({"queue": "q", "extra": "x"}, "extra"),
])
def test_configured_names_are_prometheus_metric_names(metrics: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        routing(metrics)
    assert any(error["loc"][-1] == field for error in caught.value.errors()), caught.value


# -- the picker, with no configuration -------------------------------------------------------

def busy_and_idle(engine: str) -> tuple[str, str]:
    """A busy and an idle body of ``engine``, as the fixtures above spell them."""
    if engine == "sglang":
        return SGLANG, SGLANG.replace(" 12.0\n", " 0.0\n").replace(" 9.0\n", " 0.0\n").replace(
            " 4.0\n", " 0.0\n").replace(" 0.61\n", " 0.01\n").replace(" 0.28\n", " 0.01\n")
    if engine == "tgi":
        return TGI, TGI.replace("tgi_queue_size 17", "tgi_queue_size 0").replace(
            "tgi_batch_current_size 32", "tgi_batch_current_size 0")
    if engine == "llamacpp":
        return LLAMACPP, LLAMACPP.replace("processing 4", "processing 0").replace(
            "deferred 2", "deferred 0")
    # Idle: nothing waiting in Triton's queues either (a request pending with nothing active is a
    # pod full now, to the picker).
    return TRTLLM, TRTLLM.replace('"waiting",version="1"} 6', '"waiting",version="1"} 0').replace(
        '"active",version="1"} 7', '"active",version="1"} 0').replace("0.4875", "0.01").replace(
        'nv_inference_pending_request_count{model="preprocessing",version="1"} 1',
        'nv_inference_pending_request_count{model="preprocessing",version="1"} 0')


@pytest.mark.parametrize("engine", ["sglang", "tgi", "llamacpp", "trtllm"])
def test_the_picker_avoids_a_busy_pod_of_each_engine(engine: str) -> None:
    busy_body, idle_body = busy_and_idle(engine)
    busy, idle = parse_pod(busy_body), parse_pod(idle_body)
    assert busy.waiting > idle.waiting
    picker = EndpointPicker(routing(), clock=lambda: 100.0, rng=random.Random(3))
    pool = picker.pools["pool"]
    pool.record_scrape("10.0.0.1:8000", busy, 100.0)
    pool.record_scrape("10.0.0.2:8000", idle, 100.0)
    first = picker.pick("pool", b"prompt 0", "medium")
    assert first is not None and first.endpoint == "10.0.0.2:8000", (engine, first)
    # A burst before the next scrape: each request counts on its pod until the two look alike.
    got = [picker.pick("pool", f"prompt {i}".encode(), "medium") for i in range(1, 10)]
    to_idle = sum(1 for p in [first, *got] if p is not None and p.endpoint == "10.0.0.2:8000")
    assert to_idle >= 6, (engine, to_idle)


async def test_the_scraper_reads_a_clusters_configured_names() -> None:
    """Through HTTP: a pool with ``metrics`` named reads them; the same pod unconfigured fails."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=CUSTOM)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    pod = f"127.0.0.1:{runner.addresses[0][1]}"
    named = {"queue": "myengine_queue", "running": "myengine_busy", "kv_cache": "myengine_kv"}
    config = RoutingConfig.model_validate({
        "version": 1, "models": {"m": {"clusters": ["named"]}},
        "clusters": {name: {"endpoints": [pod], "max_context": 4096,
                            "endpoint_picker": {"metrics_interval": "50ms", **extra}}
                     for name, extra in (("named", {"metrics": named}), ("plain", {}))}})
    pools: dict[str, PoolState] = {}
    scraper = Scraper(pools, config)
    await scraper.start()
    try:
        deadline = asyncio.get_running_loop().time() + 15.0
        while pools["named"].pods[pod].metrics is None or pools["plain"].pods[pod].failures == 0:
            assert asyncio.get_running_loop().time() < deadline, "no scrape of either pool"
            await asyncio.sleep(0.01)
        assert pools["named"].pods[pod].metrics == PodMetrics(waiting=7, running=2, kv_usage=0.9)
        assert pools["plain"].pods[pod].metrics is None
    finally:
        await scraper.stop()
        await runner.cleanup()
