"""parse_vllm / parse_dcgm: tables of real-shaped bodies, and every way a body can be wrong."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.picker.parse import MAX_BODY_BYTES, GpuReading, MetricsError, parse_dcgm, parse_vllm
from extproc.picker.state import PodMetrics
from simulator.metrics import SimMetrics

# The shape of vLLM V1's /metrics (0.10): engine and model_name labels, both the current and the
# deprecated names, _created samples, series whose names start like the wanted ones.
VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.6157
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 88027.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.75e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 61440.0
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries. DEPRECATED
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 9.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.75e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 12.5
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.DEPRECATED
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B"} 900.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 9.5
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 9.25
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 77.0
"""
# The inter-token histogram wins over the deprecated time-per-output-token one.
V1_METRICS = PodMetrics(waiting=3, running=7, kv_usage=0.6157, prefix_queries=88027,
                        prefix_hits=61440, token_gap_sum=9.25, token_gap_count=1000)

# Data-parallel engines, each labelled, and a LoRA-serving server's series per model_name.
MULTI = """\
vllm:num_requests_running{engine="0",model_name="base"} 2
vllm:num_requests_running{engine="1",model_name="base"} 3
vllm:num_requests_waiting{engine="0",model_name="base"} 4
vllm:num_requests_waiting{engine="1",model_name="base"} 6
vllm:num_requests_waiting{engine="0",model_name="sql-lora"} 1
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="base"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 100
vllm:prefix_cache_queries_total{engine="1",model_name="base"} 300
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 10
vllm:prefix_cache_hits_total{engine="1",model_name="base"} 30
vllm:time_per_output_token_seconds_sum{engine="0",model_name="base"} 1.5
vllm:time_per_output_token_seconds_sum{engine="1",model_name="base"} 2.5
vllm:time_per_output_token_seconds_count{engine="0",model_name="base"} 100
vllm:time_per_output_token_seconds_count{engine="1",model_name="base"} 300
vllm:time_per_output_token_seconds_created{engine="1",model_name="base"} 1.75e+09
"""

# vLLM before 0.9.2 (V0 engine names): no engine label, the old cache names only.
OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:num_requests_swapped{model_name="m"} 9.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.3
vllm:gpu_prefix_cache_queries_total{model_name="m"} 50.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 20.0
"""


def simulator_body(running: int, waiting: int, kv: float) -> str:
    metrics = SimMetrics("sim-pool")
    metrics.set_load(running, waiting, kv)
    metrics.first_token(0.05, 100)
    metrics.token(None)
    metrics.token(0.25)
    metrics.token(0.5)
    metrics.finished("stop", 0.2)
    return metrics.render().decode()


@pytest.mark.parametrize(("text", "expected"), [
    (simulator_body(3, 5, 0.42), PodMetrics(waiting=5, running=3, kv_usage=0.42,
                                            token_gap_sum=0.75, token_gap_count=2)),
    (VLLM_V1, V1_METRICS),
    (VLLM_V1.replace("\n", "\r\n"), V1_METRICS),
    (MULTI, PodMetrics(waiting=11, running=5, kv_usage=0.75, prefix_queries=400, prefix_hits=40,
                       token_gap_sum=4.0, token_gap_count=400)),
    (OLD, PodMetrics(waiting=2, running=1, kv_usage=0.3, prefix_queries=50, prefix_hits=20)),
    # No labels, a timestamp, a label value holding '}' and spaces, a tab separator.
    ('vllm:num_requests_running 4 1712345678000\n'
     'vllm:num_requests_waiting{model_name="we}ird name"} 2\n'
     'vllm:kv_cache_usage_perc\t0.5\n', PodMetrics(waiting=2, running=4, kv_usage=0.5)),
    # A longer series sharing a wanted prefix is not the wanted one.
    ('vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
     'vllm:num_requests_waiting 1\nvllm:num_requests_running 0\n'
     'vllm:kv_cache_usage_perc 1.0000001\n', PodMetrics(waiting=1, running=0, kv_usage=1.0)),
    # The first line of the body and no final newline.
    ('vllm:kv_cache_usage_perc 0.1\nvllm:num_requests_running 0\nvllm:num_requests_waiting 8',
     PodMetrics(waiting=8, running=0, kv_usage=0.1)),
], ids=["simulator", "vllm-v1", "crlf", "engines-and-loras", "old-names", "syntax", "prefix-name",
        "edges"])
def test_parse_vllm(text: str, expected: PodMetrics) -> None:
    assert parse_vllm(text) == expected


@pytest.mark.parametrize("text", [simulator_body(3, 5, 0.42), VLLM_V1, MULTI, OLD])
def test_parse_vllm_agrees_with_prometheus_client(text: str) -> None:
    """The reference parser reads the same numbers (per sample names, summed)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    parsed = parse_vllm(text)
    assert parsed.waiting == sums["vllm:num_requests_waiting"]
    assert parsed.running == sums["vllm:num_requests_running"]
    itl = "vllm:inter_token_latency_seconds" if "vllm:inter_token_latency_seconds_count" in sums \
        else "vllm:time_per_output_token_seconds"
    assert parsed.token_gap_sum == sums.get(f"{itl}_sum", 0.0)
    assert parsed.token_gap_count == sums.get(f"{itl}_count", 0.0)


@pytest.mark.parametrize(("text", "message"), [
    ("", "not vLLM metrics: no vllm:num_requests_waiting, vllm:num_requests_running, "
         "vllm:kv_cache_usage_perc"),
    ("<html><body>502 Bad Gateway</body></html>", "not vLLM metrics"),
    ("\x00\xff\xfe garbage \x89PNG", "not vLLM metrics"),
    ('vllm:num_requests_waiting{model_name="m"} 1\nvllm:num_requests_running 1\n',
     "not vLLM metrics: no vllm:kv_cache_usage_perc"),
    ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0",
     "vllm:num_requests_waiting is NaN: not a finite count"),
    ("vllm:num_requests_waiting +Inf\n", "is +Inf: not a finite count"),
    ("vllm:num_requests_waiting -3\n", "is -3: not a finite count"),
    ("vllm:num_requests_waiting lots\n", "bad value in 'vllm:num_requests_waiting lots'"),
    ('vllm:num_requests_waiting{model_name="m" 1\n', "unclosed labels"),
    ("vllm:num_requests_waiting\n", "no value in"),
    ("vllm:num_requests_waiting 1 2 3\n", "bad sample"),
    ("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
     "vllm:inter_token_latency_seconds_sum -1\n", "is -1: not a finite count"),
    ("vllm:inter_token_latency_seconds_count NaN\n", "is NaN: not a finite count"),
    ("vllm:kv_cache_usage_perc{a=\"b\"}\n", "bad sample"),
], ids=["empty", "html", "binary", "no-kv", "nan", "inf", "negative", "word", "unclosed",
        "no-value", "extra-fields", "itl-negative", "itl-nan", "labels-only"])
def test_parse_vllm_refuses(text: str, message: str) -> None:
    with pytest.raises(MetricsError) as caught:
        parse_vllm(text)
    assert message in str(caught.value)


def test_a_body_over_the_cap_is_refused_unparsed() -> None:
    huge = simulator_body(1, 1, 0.1) + "# padding\n" * (MAX_BODY_BYTES // 10)
    with pytest.raises(MetricsError, match="over 4194304 bytes"):
        parse_vllm(huge)
    with pytest.raises(MetricsError, match="over 4194304 bytes"):
        parse_dcgm(huge)


# dcgm-exporter's shape: one label set per GPU, the same for every field of that GPU.
def gpu(index: int) -> str:
    return (f'gpu="{index}",UUID="GPU-{index:08x}-aaaa",device="nvidia{index}",'
            f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",'
            f'DCGM_FI_DRIVER_VERSION="550.54.15",container="vllm",namespace="llm",pod="vllm-0"')


DCGM_TWO_GPUS = f"""\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{{{gpu(0)}}} 1980
DCGM_FI_DEV_SM_CLOCK{{{gpu(1)}}} 1410
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{{{gpu(0)}}} 41
DCGM_FI_DEV_GPU_TEMP{{{gpu(1)}}} 83
# HELP DCGM_FI_DEV_FB_FREE Frame buffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{gpu(0)}}} 61440
DCGM_FI_DEV_FB_FREE{{{gpu(1)}}} 20480
# HELP DCGM_FI_DEV_FB_USED Frame buffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{gpu(0)}}} 20480
DCGM_FI_DEV_FB_USED{{{gpu(1)}}} 61440
# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS Current clock throttle reasons.
# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{gpu(0)}}} 0
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{gpu(1)}}} REASONS
"""


def dcgm(reasons: int, name: str = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS") -> str:
    return (DCGM_TWO_GPUS.replace("REASONS\n", f"{reasons}\n")
            .replace("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", name))


@pytest.mark.parametrize(("text", "expected"), [
    (dcgm(0), GpuReading(83.0, 0.75, False)),
    (dcgm(0x01), GpuReading(83.0, 0.75, False)),   # GPU idle
    (dcgm(0x04), GpuReading(83.0, 0.75, False)),   # SW power cap: a busy GPU's normal state
    (dcgm(0x10 | 0x100), GpuReading(83.0, 0.75, False)),  # sync boost, display clocks
    (dcgm(0x08), GpuReading(83.0, 0.75, True)),    # HW slowdown
    (dcgm(0x20), GpuReading(83.0, 0.75, True)),    # SW thermal
    (dcgm(0x40 | 0x04), GpuReading(83.0, 0.75, True)),  # HW thermal
    (dcgm(0x80), GpuReading(83.0, 0.75, True)),    # HW power brake
    (dcgm(0x20, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), GpuReading(83.0, 0.75, True)),  # DCGM >= 3.3
    (f"DCGM_FI_DEV_GPU_TEMP{{{gpu(0)}}} 55\n", GpuReading(55.0, None, None)),
    # Used without its free is no fraction; a 0 MiB GPU neither.
    (f"DCGM_FI_DEV_FB_USED{{{gpu(0)}}} 5\nDCGM_FI_DEV_FB_USED{{{gpu(1)}}} 0\n"
     f"DCGM_FI_DEV_FB_FREE{{{gpu(1)}}} 0\nDCGM_FI_DEV_GPU_TEMP{{{gpu(1)}}} 30\n",
     GpuReading(30.0, None, None)),
], ids=["none", "idle", "power-cap", "boost-display", "hw-slowdown", "sw-thermal", "hw-thermal",
        "power-brake", "event-reasons-name", "temp-only", "unpaired-fb"])
def test_parse_dcgm_worst_gpu(text: str, expected: GpuReading) -> None:
    assert parse_dcgm(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "not dcgm-exporter metrics"),
    ("vllm:num_requests_waiting 1\n", "not dcgm-exporter metrics"),
    (f"DCGM_FI_DEV_GPU_TEMP{{{gpu(0)}}} hot\n", "bad value"),
    (f"DCGM_FI_DEV_GPU_TEMP{{{gpu(0)}}} NaN\n", "not a finite count"),
])
def test_parse_dcgm_refuses(text: str, message: str) -> None:
    with pytest.raises(MetricsError) as caught:
        parse_dcgm(text)
    assert message in str(caught.value)
