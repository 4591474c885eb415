"""What the numbers were measured on: CPU, memory, kernel, and the versions of every tool."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from sidecar_runtime.process.procs import envoy_binary


def _first_line(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0].strip() if text else "unavailable"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as handle:
        kib = int(handle.readline().split()[1])
    return round(kib / 1024 / 1024, 1)


def calibrate() -> float:
    """CPU seconds this machine takes for 10 M iterations of a Python loop, in a child process.

    A yardstick for comparing machines and runs: about 0.4 s on an idle current desktop core;
    more when the cores are slow or shared.
    """
    code = ("import time\nt = time.process_time()\nx = 0\nfor i in range(10_000_000):\n"
            "    x += i\nprint(time.process_time() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    try:
        return round(float(done.stdout.strip()), 3)
    except ValueError:
        return -1.0


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def describe(tool: str, litellm_version: str | None) -> dict[str, Any]:
    commit = _first_line(["git", "-C", os.path.dirname(__file__), "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "-C", os.path.dirname(__file__), "status", "--porcelain",
                         "--", "extproc", "ratelimit", "bench"])
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": _first_line([envoy_binary(), "--version"]).split("version:")[-1].strip(),
        "loadgen": tool if tool == "python" else _first_line(["wrk", "--version"]),
        "grpcio": _pkg("grpcio"),
        "uvloop": _pkg("uvloop"),
        "litellm": litellm_version or "not run",
        "python_loop_10m_cpu_s": calibrate(),
        "commit": commit + (" (with local changes)" if dirty not in ("", "unavailable") else ""),
    }
