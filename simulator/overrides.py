"""What ``POST /sim/state`` may set: values that replace what the metrics endpoints report.

A simulator-only control (vLLM has nothing like it) so tests and benchmarks can make a pod look
busy, full, hot or broken without loading it. The JSON object replaces every earlier override;
``{}`` or ``{"clear": true}`` removes them all; a key set to ``null`` is not overridden::

    {"waiting": 40, "running": 3, "kv_usage": 0.99,          # /metrics gauges
     "gpu_temp_c": 92, "fb_used_mib": 80000, "fb_free_mib": 1920,
     "throttled": true, "throttle_reasons": 96,               # /dcgm/metrics gauges
     "fail_metrics": true, "fail_dcgm": true,                 # answer 500 instead
     "fail_requests": true}                                   # every generation: a 500

``throttled: true`` reports SW and HW thermal slowdown (0x20 | 0x40), ``false`` no reason;
``throttle_reasons`` gives the exact bitmask (only one of the two). Only what is reported
changes: admission, pacing and the prefix cache keep running on the real state, except with
``fail_requests``: each chat and completions request then gets vLLM's 500 for a dead engine at
once, while ``/metrics`` goes on reporting (an idle pod: vLLM kept up after its engine died,
``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``, or a server that fails every request for another cause).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from simulator.dcgm import THERMAL_SLOWDOWN, GpuReading
from simulator.errors import bad_request

_MAX_MASK = 2**64 - 1


@dataclass(frozen=True)
class SimOverrides:
    """The reported values in force; ``None`` leaves the real value."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    gpu_temp_c: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    throttle_reasons: int | None = None
    fail_metrics: bool = False
    fail_dcgm: bool = False
    fail_requests: bool = False

    def gpu(self, real: GpuReading) -> GpuReading:
        """What ``/dcgm/metrics`` reports: ``real`` with the GPU overrides applied."""
        return GpuReading(
            temp_c=real.temp_c if self.gpu_temp_c is None else self.gpu_temp_c,
            fb_used_mib=real.fb_used_mib if self.fb_used_mib is None else self.fb_used_mib,
            fb_free_mib=real.fb_free_mib if self.fb_free_mib is None else self.fb_free_mib,
            throttle_reasons=(
                real.throttle_reasons if self.throttle_reasons is None else self.throttle_reasons
            ),
        )

    def as_json(self) -> dict[str, Any]:
        """The overrides in force, without the keys left at their real values."""
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


NONE = SimOverrides()


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{key} must be a non-negative integer", key)
    return value


def _number(key: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad_request(f"{key} must be between {low:g} and {high:g}", key)
    return float(value)


def _flag(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false", key)
    return value


def parse_overrides(body: object) -> SimOverrides:
    """The overrides a ``POST /sim/state`` body asks for; a 400 ``SimError`` when it is not valid."""
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    given = {k: v for k, v in body.items() if v is not None}
    known = {f for f in SimOverrides.__dataclass_fields__} | {"throttled", "clear"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if _flag("clear", given.pop("clear", False)):
        if given:
            raise bad_request("clear takes no other keys", "clear")
        return NONE
    if "throttled" in given and "throttle_reasons" in given:
        raise bad_request("give throttled or throttle_reasons, not both", "throttled")
    reasons: int | None = None
    if "throttled" in given:
        reasons = THERMAL_SLOWDOWN if _flag("throttled", given["throttled"]) else 0
    if "throttle_reasons" in given:
        reasons = _count("throttle_reasons", given["throttle_reasons"])
        if reasons > _MAX_MASK:
            raise bad_request("throttle_reasons must fit in 64 bits", "throttle_reasons")
    return SimOverrides(
        waiting=_count("waiting", given["waiting"]) if "waiting" in given else None,
        running=_count("running", given["running"]) if "running" in given else None,
        kv_usage=_number("kv_usage", given["kv_usage"], 0, 1) if "kv_usage" in given else None,
        gpu_temp_c=_number("gpu_temp_c", given["gpu_temp_c"], -50, 200) if "gpu_temp_c" in given else None,
        fb_used_mib=_mib("fb_used_mib", given),
        fb_free_mib=_mib("fb_free_mib", given),
        throttle_reasons=reasons,
        fail_metrics=_flag("fail_metrics", given.get("fail_metrics", False)),
        fail_dcgm=_flag("fail_dcgm", given.get("fail_dcgm", False)),
        fail_requests=_flag("fail_requests", given.get("fail_requests", False)),
    )


def _mib(key: str, given: dict[str, Any]) -> float | None:
    return _number(key, given[key], 0, 1e9) if key in given else None
