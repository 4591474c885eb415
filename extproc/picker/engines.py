"""Which series of a pod's ``/metrics`` are its load, per engine, recognised by name.

A pool may run any OpenAI-compatible engine. Each writes its own names, and each
its own text: the parsing is :mod:`extproc.picker.parse`'s, which reads any valid exposition.
:func:`parse_pod` finds the engine by the names in the body, with no configuration; a cluster's
``endpoint_picker.metrics`` names the series for any other engine (:meth:`Dialect.named`).

Waiting and running are summed over every label set (ranks, models); KV use, 0 to 1, is the
fullest label set:

- vLLM: :func:`~extproc.picker.parse.parse_vllm` (also prefix-cache counters and speed).
- SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``.
- TGI: ``tgi_queue_size``, ``tgi_batch_current_size``; no KV gauge.
- llama.cpp: ``llamacpp:requests_deferred``, ``llamacpp:requests_processing``,
  ``llamacpp:kv_cache_usage_ratio`` (older builds only).
- TensorRT-LLM on Triton: ``nv_trt_llm_request_metrics{request_type="waiting"}`` plus
  ``nv_inference_pending_request_count``; ``nv_trt_llm_request_metrics{request_type="active"}``;
  ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}``, else its ``used`` /
  ``max`` of one label set.

Sources (names only): SGLang ``python/sglang/srt/metrics/collector.py``
(``SchedulerMetricsCollector``, prometheus_client in multiprocess mode: labels sorted, a series
per ``tp_rank``/``dp_rank`` set); TGI ``router/src`` (``metrics::gauge!`` through the Rust
``metrics-exporter-prometheus``: a blank line after each family, integers without ``.0``);
llama.cpp ``tools/server/server.cpp`` (``handle_metrics`` writes the text by hand, C++ ``<<``
numbers such as ``1.23457e+06``; ``kv_cache_usage_ratio`` and ``kv_cache_tokens`` were dropped
when the server moved to the memory API); Triton's TensorRT-LLM backend
(``inflight_batcher_llm/src/custom_metrics_reporter``, its README's metrics section) and Triton
core's ``nv_inference_pending_request_count`` (``docs/user_guide/metrics.md``), both through
prometheus-cpp's text serializer (labels sorted). Pending requests are those Triton's scheduler
holds before the backend sees them, ``waiting`` those the TRT-LLM executor has queued: two
stages of one queue, so both count.

An engine whose body has no KV gauge reads ``kv_usage=None`` and is scored on what it has
(:mod:`extproc.picker.scoring`). Only vLLM gives prefix-cache counters and a per-token time:
on the others the `prefix` scorer uses extproc's own index as ever, and `speed` is neutral.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from extproc.picker.parse import (
    MAX_BODY_BYTES,
    MetricsError,
    has_series,
    label_values,
    parse_vllm,
    samples,
)
from extproc.picker.state import PodMetrics


@dataclass(frozen=True)
class Series:
    """One metric name, and optionally the ``label="value"`` its samples must carry (Triton
    keeps several gauges under one name, told apart by a label)."""

    name: str
    label: tuple[str, str] | None = None

    def __str__(self) -> str:
        return self.name if self.label is None else f'{self.name}{{{self.label[0]}="{self.label[1]}"}}'


@dataclass(frozen=True)
class Dialect:
    """An engine's load series. ``waiting`` and ``running`` are summed over every series listed
    and every label set (data-parallel ranks, models); KV use is the fullest label set of the
    first ``kv`` series present, else ``used / max`` of ``kv_blocks`` paired per label set, else
    unknown (None). An empty ``running`` reads 0."""

    engine: str
    waiting: tuple[Series, ...]
    running: tuple[Series, ...]
    kv: tuple[Series, ...] = ()
    kv_blocks: tuple[Series, Series] | None = None

    @classmethod
    def named(cls, queue: str, running: str | None, kv_cache: str | None) -> Dialect:
        """The series a cluster's ``endpoint_picker.metrics`` names."""
        return cls("configured", (Series(queue),), () if running is None else (Series(running),),
                   () if kv_cache is None else (Series(kv_cache),))


_TRT_REQUESTS = "nv_trt_llm_request_metrics"
_TRT_KV = "nv_trt_llm_kv_cache_block_metrics"

SGLANG = Dialect("sglang", (Series("sglang:num_queue_reqs"),), (Series("sglang:num_running_reqs"),),
                 (Series("sglang:token_usage"),))
TGI = Dialect("tgi", (Series("tgi_queue_size"),), (Series("tgi_batch_current_size"),))
LLAMACPP = Dialect("llamacpp", (Series("llamacpp:requests_deferred"),),
                   (Series("llamacpp:requests_processing"),),
                   (Series("llamacpp:kv_cache_usage_ratio"),))
TRTLLM = Dialect(
    "trtllm",
    (Series(_TRT_REQUESTS, ("request_type", "waiting")), Series("nv_inference_pending_request_count")),
    (Series(_TRT_REQUESTS, ("request_type", "active")),),
    (Series(_TRT_KV, ("kv_cache_block_type", "fraction")),),
    (Series(_TRT_KV, ("kv_cache_block_type", "used")), Series(_TRT_KV, ("kv_cache_block_type", "max"))),
)
DIALECTS = (SGLANG, TGI, LLAMACPP, TRTLLM)
"""Tried in this order after vLLM; an engine is recognised by its ``running`` series."""

_VLLM_SIGNS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_pod(text: str, dialect: Dialect | None = None) -> PodMetrics:
    """The pod's load from its ``/metrics`` text: read as ``dialect`` when one is configured,
    else as the engine whose names the body has (vLLM first: the common case costs one
    ``str.find`` more than :func:`~extproc.picker.parse.parse_vllm` alone)."""
    if len(text) > MAX_BODY_BYTES:
        raise MetricsError(f"metrics body over {MAX_BODY_BYTES} bytes")
    if dialect is not None:
        return parse_dialect(text, dialect)
    if any(has_series(text, name) for name in _VLLM_SIGNS):
        return parse_vllm(text)
    for known in DIALECTS:
        if any(has_series(text, s.name) for s in known.running):
            return parse_dialect(text, known)
    names = ", ".join([_VLLM_SIGNS[0], *(str(d.running[0]) for d in DIALECTS)])
    raise MetricsError(f"no engine's load metrics (none of {names}); "
                       "name them in endpoint_picker.metrics")


def _values(text: str, series: Series) -> Iterator[tuple[str, float]]:
    """``(labels, value)`` of each sample of ``series``; labels without the selecting one."""
    for _, labels, value in samples(text, (series.name,)):
        if series.label is None:
            yield labels, value
            continue
        found = label_values(labels)
        if found.pop(series.label[0], None) == series.label[1]:
            yield ",".join(f"{k}={v!r}" for k, v in sorted(found.items())), value


def _total(text: str, series: tuple[Series, ...]) -> float | None:
    """The sum of every sample of ``series``; None when none has any."""
    total: float | None = None
    for one in series:
        for _, value in _values(text, one):
            total = value if total is None else total + value
    return total


def _kv(text: str, dialect: Dialect) -> float | None:
    for one in dialect.kv:
        found = [value for _, value in _values(text, one)]
        if found:
            return min(1.0, max(found))
    if dialect.kv_blocks is not None:
        used = dict(_values(text, dialect.kv_blocks[0]))
        most = dict(_values(text, dialect.kv_blocks[1]))
        fractions = [used[k] / most[k] for k in used.keys() & most.keys() if most[k] > 0]
        if fractions:
            return min(1.0, max(fractions))
    return None


def parse_dialect(text: str, dialect: Dialect) -> PodMetrics:
    """The load ``dialect`` names; a body without its waiting or running series (or a KV series
    a configuration names) is not that engine's."""
    waiting = _total(text, dialect.waiting)
    running = _total(text, dialect.running) if dialect.running else 0.0
    kv = _kv(text, dialect)
    missing = [" or ".join(map(str, group)) for group, value in
               ((dialect.waiting, waiting), (dialect.running, running)) if value is None]
    if dialect.engine == "configured" and dialect.kv and kv is None:
        missing.append(str(dialect.kv[0]))
    if missing or waiting is None or running is None:
        raise MetricsError(f"not {dialect.engine} metrics: no {', '.join(missing)}")
    return PodMetrics(waiting=waiting, running=running, kv_usage=kv)
