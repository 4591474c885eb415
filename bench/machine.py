"""What the numbers were measured on: CPU, memory, kernel, and the versions of every tool."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from llm_sidecar.procs import envoy_binary


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
        "commit": commit + (" (with local changes)" if dirty not in ("", "unavailable") else ""),
    }
