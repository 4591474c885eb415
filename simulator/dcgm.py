"""GPU gauges shaped like NVIDIA dcgm-exporter's, served by the simulator at ``/dcgm/metrics``.

A real pod's GPU is watched by dcgm-exporter (a DaemonSet, port 9400); the simulator serves the
same series on its own port so a picker configured with a DCGM URL has something to read. Names,
help texts and labels (``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``,
``Hostname``) follow dcgm-exporter's default collectors.

The simulated GPU is an 80 GB A100 running vLLM: vLLM takes 90 % of the framebuffer at start
(``--gpu-memory-utilization``), so used and free memory stay flat whatever the load; the
temperature rises with KV-cache use, from 34 °C idle to 80 °C full, below any slowdown
threshold, so only ``POST /sim/state`` makes a simulated GPU throttle. An idle GPU reports the
GPU_IDLE reason, as real ones do, so a reader must look at the thermal bits, not at "non-zero".

Clock event reason bits are DCGM's ``DCGM_CLOCKS_EVENT_REASON_*`` (``dcgm_fields.h``, mirrored in
NVIDIA/DCGM ``testing/python3/dcgm_fields.py``), one to one with NVML's throttle reasons.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, generate_latest

GPU_IDLE = 0x01
SW_POWER_CAP = 0x04
HW_SLOWDOWN = 0x08
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
THERMAL_SLOWDOWN = SW_THERMAL | HW_THERMAL
"""What ``{"throttled": true}`` reports: both thermal slowdown reasons."""

MODEL_NAME = "NVIDIA A100-SXM4-80GB"
FB_TOTAL_MIB = 81920
_VLLM_MEMORY_SHARE = 0.9  # vLLM's default --gpu-memory-utilization
_IDLE_TEMP_C = 34.0
_FULL_TEMP_C = 80.0


@dataclass(frozen=True)
class GpuReading:
    """One reading of the simulated GPU."""

    temp_c: float
    fb_used_mib: float
    fb_free_mib: float
    throttle_reasons: int


def simulated_reading(kv_usage: float, running: int) -> GpuReading:
    """The GPU of a pod whose KV cache is ``kv_usage`` full with ``running`` sequences."""
    used = round(FB_TOTAL_MIB * _VLLM_MEMORY_SHARE)
    temp = _IDLE_TEMP_C + (_FULL_TEMP_C - _IDLE_TEMP_C) * min(1.0, max(0.0, kv_usage))
    return GpuReading(
        temp_c=round(temp),
        fb_used_mib=used,
        fb_free_mib=FB_TOTAL_MIB - used,
        throttle_reasons=GPU_IDLE if running == 0 else 0,
    )


class DcgmExporter:
    """The gauges of one simulated GPU (``gpu="0"``) on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {
            "gpu": "0",
            "UUID": f"GPU-{uuid.uuid4()}",
            "pci_bus_id": "00000000:00:1E.0",
            "device": "nvidia0",
            "modelName": MODEL_NAME,
            "Hostname": socket.gethostname(),
        }
        names = list(labels)
        reg = self.registry
        self._temp = Gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", names, registry=reg)
        self._used = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", names, registry=reg)
        self._free = Gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", names, registry=reg)
        self._reasons = Gauge(
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons.", names, registry=reg
        )
        self._labels = labels

    def render(self, reading: GpuReading) -> bytes:
        """The Prometheus text of ``reading``."""
        self._temp.labels(**self._labels).set(reading.temp_c)
        self._used.labels(**self._labels).set(reading.fb_used_mib)
        self._free.labels(**self._labels).set(reading.fb_free_mib)
        self._reasons.labels(**self._labels).set(reading.throttle_reasons)
        return generate_latest(self.registry)
