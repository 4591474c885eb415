"""The load gauges of engines other than vLLM, written the way each engine's own exporter writes
them (``llm-sidecar sim --engine``), so the picker and the tests meet each engine's text.

Names and shapes from each engine's source (names only, no code): SGLang
``python/sglang/srt/metrics/collector.py`` through prometheus_client's multiprocess collector
(labels sorted, floats as ``3.0``); TGI ``router/src`` through the Rust
``metrics-exporter-prometheus`` (``# TYPE`` only, integers without ``.0``, a blank line after
each family; no KV gauge); llama.cpp ``tools/server/server.cpp`` ``handle_metrics`` (hand-written
``# HELP``/``# TYPE``/value, C++ stream numbers like ``1.23457e+06``; current builds have no KV
gauge); Triton core's ``nv_inference_pending_request_count`` and the TensorRT-LLM backend's
``nv_trt_llm_request_metrics`` / ``nv_trt_llm_kv_cache_block_metrics`` (its README's metrics
section) through prometheus-cpp's text serializer (labels sorted, 16 significant digits).
vLLM's own exposition stays :class:`simulator.metrics.SimMetrics`' prometheus_client registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

ENGINES = ("vllm", "sglang", "tgi", "llamacpp", "trtllm")
"""What ``--engine`` accepts; vLLM is the default."""

_TRT_MODEL = 'model="tensorrt_llm"'
_TRT_BLOCKS = 4096
"""KV-cache blocks the simulated TensorRT-LLM engine reports as its ``max``."""
_TRT_TOKENS_PER_BLOCK = 64


@dataclass(frozen=True)
class Load:
    """What a simulator reports: its scheduler's gauges (overrides applied) and token counters."""

    running: float
    waiting: float
    kv_usage: float
    prompt_tokens: int
    generation_tokens: int
    created: float
    """Unix time the counters started (prometheus_client's ``_created``)."""


def render(engine: str, model: str, load: Load) -> str:
    """``load`` as ``engine``'s ``/metrics`` text (not ``vllm``: that is a registry's)."""
    if engine == "sglang":
        return _sglang(model, load)
    if engine == "tgi":
        return _tgi(load)
    if engine == "llamacpp":
        return _llamacpp(load)
    if engine == "trtllm":
        return _trtllm(load)
    raise ValueError(f"no exposition for engine {engine!r}")


def _sglang(model: str, load: Load) -> str:
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    labels = f'{{engine_type="unified",model_name="{escaped}",pp_rank="0",tp_rank="0"}}'
    out: list[str] = []
    for name, kind, text, value in (
        ("sglang:num_running_reqs", "gauge", "The number of running requests.", load.running),
        ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
         load.waiting),
        ("sglang:token_usage", "gauge", "The token usage.", load.kv_usage),
        ("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.",
         load.prompt_tokens),
        ("sglang:generation_tokens", "counter", "Number of generation tokens processed.",
         load.generation_tokens),
    ):
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        if kind == "counter":
            out += [f"{name}_total{labels} {_python(value)}",
                    f"{name}_created{labels} {_python(load.created)}"]
        else:
            out.append(f"{name}{labels} {_python(value)}")
    return "\n".join(out) + "\n"


def _python(value: float) -> str:
    """prometheus_client's number format: ``3.0``, ``1.234567e+06``."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _tgi(load: Load) -> str:
    families = (("tgi_queue_size", "gauge", load.waiting),
                ("tgi_batch_current_size", "gauge", load.running))
    return "".join(f"# TYPE {name} {kind}\n{name} {_rust(value)}\n\n"
                   for name, kind, value in families)


def _rust(value: float) -> str:
    """Rust's ``Display`` of an f64: ``3``, not ``3.0``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _llamacpp(load: Load) -> str:
    families = (
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", load.prompt_tokens),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
         load.generation_tokens),
        ("requests_processing", "gauge", "Number of requests processing.", load.running),
        ("requests_deferred", "gauge", "Number of requests deferred.", load.waiting),
    )
    return "".join(f"# HELP llamacpp:{name} {text}\n# TYPE llamacpp:{name} {kind}\n"
                   f"llamacpp:{name} {float(value):g}\n" for name, kind, text, value in families)


def _trtllm(load: Load) -> str:
    used = round(load.kv_usage * _TRT_BLOCKS)
    requests = (("waiting", load.waiting), ("context", 0), ("scheduled", load.running),
                ("max", 256), ("active", load.running))
    blocks = (("fraction", load.kv_usage), ("tokens_per", _TRT_TOKENS_PER_BLOCK), ("used", used),
              ("free", _TRT_BLOCKS - used), ("max", _TRT_BLOCKS))
    out = ["# HELP nv_inference_pending_request_count Instantaneous number of pending requests "
           "awaiting execution per-model.",
           "# TYPE nv_inference_pending_request_count gauge",
           f'nv_inference_pending_request_count{{{_TRT_MODEL},version="1"}} 0',
           "# HELP nv_trt_llm_request_metrics TRT LLM request metrics",
           "# TYPE nv_trt_llm_request_metrics gauge"]
    out += [f'nv_trt_llm_request_metrics{{{_TRT_MODEL},request_type="{kind}",version="1"}} '
            f"{float(value):.16g}" for kind, value in requests]
    out += ["# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics",
            "# TYPE nv_trt_llm_kv_cache_block_metrics gauge"]
    out += [f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="{kind}",{_TRT_MODEL},'
            f'version="1"}} {float(value):.16g}' for kind, value in blocks]
    return "\n".join(out) + "\n"
