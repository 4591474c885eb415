"""Read a pod's load out of Prometheus text: vLLM's ``/metrics`` and dcgm-exporter's (the other
engines' names are in :mod:`extproc.picker.engines`, read with the same helpers).

Pure: text in, numbers out, no I/O. Hand-rolled rather than prometheus_client's text parser: we
read a handful of series out of hundreds of histogram lines, so each wanted name is found with
``str.find`` (a C scan) and no other line is looked at in Python. Measured on the simulator's
body (8 KB, 117 lines) ~40 us against ~2 ms for prometheus_client's parser; with 20 models
(165 KB, 2340 lines) ~0.5 ms against ~41 ms (2-core CI machine, under load).

Any valid text exposition reads the same, whoever wrote it: labels in any order (with ``le`` or
a ``}`` inside a value), ``3`` or ``3.0`` or ``1.23457e+06``, blank lines, ``# HELP``/``# TYPE``,
``_created`` and ``_sum``-before-bucket families, ``NaN``/``+Inf`` in series not read, ``\r\n``
line ends, a timestamp after the value: only lines that start with a
wanted name are parsed, so the rest may be anything the format allows.

Every way a body can be wrong (not vLLM, a bad number, a negative queue, too big) raises
:class:`MetricsError`; the scraper counts it as a failed scrape. Nothing here raises anything else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from extproc.picker.state import PodMetrics

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Larger bodies are refused unread (a real vLLM body is tens of KB; one serving hundreds of
LoRAs a few hundred KB)."""


class MetricsError(ValueError):
    """A metrics body that cannot be read as what it should be; the message says why."""


# vLLM's names (vllm/v1/metrics/loggers.py). vLLM 0.9.2 renamed ``vllm:gpu_prefix_cache_queries``
# and ``_hits`` to ``vllm:prefix_cache_queries`` / ``_hits`` (both exposed until 0.11, the old
# ones behind --show-hidden-metrics-for-version) and ``vllm:gpu_cache_usage_perc`` to
# ``vllm:kv_cache_usage_perc``. prometheus_client exposes counters with ``_total``.
_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
_QUERIES = "vllm:prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"
_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
# Time between a sequence's output tokens (a histogram: only its _sum and _count are read). vLLM
# 0.11 added ``vllm:inter_token_latency_seconds`` and deprecated the identical
# ``vllm:time_per_output_token_seconds`` (both exposed for a while, the old one then hidden).
_ITL_SUM = "vllm:inter_token_latency_seconds_sum"
_ITL_COUNT = "vllm:inter_token_latency_seconds_count"
_TPOT_SUM = "vllm:time_per_output_token_seconds_sum"
_TPOT_COUNT = "vllm:time_per_output_token_seconds_count"
_VLLM_NAMES = (_WAITING, _RUNNING, _KV, _KV_OLD, _QUERIES, _HITS, _QUERIES_OLD, _HITS_OLD,
               _ITL_SUM, _ITL_COUNT, _TPOT_SUM, _TPOT_COUNT)

_TEMP = "DCGM_FI_DEV_GPU_TEMP"
_FB_USED = "DCGM_FI_DEV_FB_USED"
_FB_FREE = "DCGM_FI_DEV_FB_FREE"
_THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
_EVENTS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
"""DCGM 3.3 renamed the throttle reasons field (id 112) to clock event reasons; dcgm-exporter
exposes whichever its counters file names."""
_DCGM_NAMES = (_TEMP, _FB_USED, _FB_FREE, _THROTTLE, _EVENTS)

# Clock event (throttle) reason bits, from NVIDIA/DCGM dcgmlib/dcgm_fields.h
# (DCGM_CLOCKS_EVENT_REASON_*): HW_SLOWDOWN 0x08, SW_THERMAL 0x20, HW_THERMAL 0x40,
# HW_POWER_BRAKE 0x80. These four are the mask DCGM's own diagnostics fail a GPU on
# (nvvs DcgmRecorder::CheckForThrottling). SW_POWER_CAP (0x04) is left out on purpose: a fully
# busy GPU sits at its power cap as a matter of course, so counting it would mark every loaded
# pod throttled; GPU_IDLE (0x01), app clocks (0x02), sync boost (0x10) and display clocks
# (0x100) are not slowdowns.
THROTTLE_MASK = 0x08 | 0x20 | 0x40 | 0x80


class GpuReading(NamedTuple):
    """The worst GPU of one dcgm-exporter body; None where the body had no such field."""

    temp_c: float | None
    mem_used_frac: float | None
    throttled: bool | None


def _lines(text: str, name: str) -> Iterator[str]:
    """Every line of ``text`` that starts with ``name`` (str.find: a C scan, ~no Python per
    line of the hundreds of other series)."""
    at = text.find(name)
    while at != -1:
        end = text.find("\n", at)
        end = len(text) if end == -1 else end
        if at == 0 or text[at - 1] == "\n":
            yield text[at:end]
        at = text.find(name, end)


def has_series(text: str, name: str) -> bool:
    """Whether some sample line is of series ``name`` (not merely one that starts the same)."""
    return any(line[len(name):len(name) + 1] in ("{", " ", "\t") for line in _lines(text, name))


def samples(text: str, names: tuple[str, ...]) -> Iterator[tuple[str, str, float]]:
    """``(name, labels, value)`` of every sample of ``names``; other lines are not parsed."""
    if len(text) > MAX_BODY_BYTES:
        raise MetricsError(f"metrics body over {MAX_BODY_BYTES} bytes")
    for wanted in names:
        for line in _lines(text, wanted):
            sample = _sample(line, wanted)
            if sample is not None:
                yield wanted, *sample


def _sample(line: str, name: str) -> tuple[str, float] | None:
    """``(labels, value)`` of a line starting with ``name``; None when it is another series
    that only starts the same (``..._waiting_by_reason``)."""
    after = line[len(name):len(name) + 1]
    if after == "{":
        end = line.rfind("}")  # label values may hold '}', the value and timestamp never do
        if end == -1:
            raise MetricsError(f"unclosed labels in {line[:120]!r}")
        labels, rest = line[len(name) + 1:end], line[end + 1:]
    elif after in (" ", "\t"):
        labels, rest = "", line[len(name):]
    elif after in ("", "\r"):
        raise MetricsError(f"no value in {line[:120]!r}")
    else:
        return None
    parts = rest.split()
    if not 1 <= len(parts) <= 2:  # value, optional timestamp
        raise MetricsError(f"bad sample {line[:120]!r}")
    try:
        value = float(parts[0])
    except ValueError:
        raise MetricsError(f"bad value in {line[:120]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise MetricsError(f"{name} is {parts[0]}: not a finite count")
    return labels, value


def label_values(labels: str) -> dict[str, str]:
    """The ``name="value"`` pairs of a sample's label text (between its braces), in any order,
    spaces after commas and a trailing comma allowed, ``\\`` ``\"`` ``\n`` unescaped."""
    found: dict[str, str] = {}
    at, size = 0, len(labels)
    while at < size:
        eq = labels.find("=", at)
        if eq == -1:
            if labels[at:].strip(" \t,"):
                raise MetricsError(f"bad labels {labels[:120]!r}")
            break
        key = labels[at:eq].strip(" \t,")
        quote = eq + 1
        while quote < size and labels[quote] in " \t":
            quote += 1
        if quote >= size or labels[quote] != '"' or not key:
            raise MetricsError(f"bad labels {labels[:120]!r}")
        value: list[str] = []
        at = quote + 1
        while at < size and labels[at] != '"':
            if labels[at] == "\\" and at + 1 < size:
                at += 1
                value.append("\n" if labels[at] == "n" else labels[at])
            else:
                value.append(labels[at])
            at += 1
        if at >= size:
            raise MetricsError(f"unclosed label value in {labels[:120]!r}")
        found[key] = "".join(value)
        at += 1
    return found


def parse_vllm(text: str) -> PodMetrics:
    """vLLM's load from its ``/metrics`` text.

    A server with several models or LoRA adapters (or data-parallel engines) labels each series
    per ``model_name`` / ``engine``: queues and prefix counters are summed across label sets;
    KV-cache use is the fullest one (it is a fraction of each engine's own cache); the
    inter-token histogram's ``_sum`` and ``_count`` are summed too (their ratio between two
    scrapes is the pod's time per output token). The current names win over the deprecated
    ones when a server exposes both. Waiting, running and KV use must be present: a body
    without them is not vLLM's; one without the inter-token histogram reads as 0 tokens (speed
    unknown).
    """
    sums = dict.fromkeys(_VLLM_NAMES, 0.0)
    seen: set[str] = set()
    kv = dict.fromkeys((_KV, _KV_OLD), 0.0)
    for name, _labels, value in samples(text, _VLLM_NAMES):
        seen.add(name)
        if name in kv:
            kv[name] = max(kv[name], value)
        else:
            sums[name] += value
    kv_name = _KV if _KV in seen else _KV_OLD
    missing = [n for n in (_WAITING, _RUNNING) if n not in seen]
    if kv_name not in seen:
        missing.append(_KV)
    if missing:
        raise MetricsError(f"not vLLM metrics: no {', '.join(missing)}")
    new_prefix = _QUERIES in seen
    itl = _ITL_COUNT in seen
    return PodMetrics(
        waiting=sums[_WAITING],
        running=sums[_RUNNING],
        kv_usage=min(1.0, kv[kv_name]),
        prefix_queries=sums[_QUERIES if new_prefix else _QUERIES_OLD],
        prefix_hits=sums[_HITS if new_prefix else _HITS_OLD],
        token_gap_sum=sums[_ITL_SUM if itl else _TPOT_SUM],
        token_gap_count=sums[_ITL_COUNT if itl else _TPOT_COUNT],
    )


def parse_dcgm(text: str) -> GpuReading:
    """The worst GPU in a dcgm-exporter body: the hottest, the fullest framebuffer, and
    throttled if any GPU has a thermal or power-brake slowdown bit (:data:`THROTTLE_MASK`).

    dcgm-exporter labels every field of one GPU with the same label set, which pairs each GPU's
    used and free framebuffer. A body with none of the fields is an error (a wrong URL).
    """
    temps: list[float] = []
    used: dict[str, float] = {}
    free: dict[str, float] = {}
    throttled: bool | None = None
    for name, labels, value in samples(text, _DCGM_NAMES):
        if name == _TEMP:
            temps.append(value)
        elif name == _FB_USED:
            used[labels] = value
        elif name == _FB_FREE:
            free[labels] = value
        else:
            throttled = bool(throttled) or bool(int(value) & THROTTLE_MASK)
    fractions = [used[k] / (used[k] + free[k]) for k in used.keys() & free.keys()
                 if used[k] + free[k] > 0]
    if not temps and not fractions and throttled is None:
        raise MetricsError(f"not dcgm-exporter metrics: no {_TEMP}, {_FB_USED}/{_FB_FREE} "
                           f"or {_THROTTLE}")
    return GpuReading(max(temps) if temps else None, max(fractions) if fractions else None,
                      throttled)
