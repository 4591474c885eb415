"""A second replica of extproc and ratelimit behind the running gateway's Envoy, and a pod that
breaks connections on purpose.

Replicas read the same routing YAML and environment (so the same Redis); Envoy's two gRPC
clusters get the new endpoints by rewriting the rendered bootstrap and restarting Envoy, which
is what a second pod behind a Kubernetes Service gives a real deployment.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from dataclasses import dataclass, field

import yaml

from routing.render.clusters import EXTPROC_CLUSTER, RATELIMIT_CLUSTER
from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_http_ok, wait_tcp
from tests.harness.gateway import Gateway

CLUSTER_OF = {"extproc": EXTPROC_CLUSTER, "ratelimit": RATELIMIT_CLUSTER}


@dataclass
class Replica:
    name: str
    port: int
    metrics_port: int
    child: Child

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"


def start_replica(gw: Gateway, kind: str, suffix: str = "b") -> Replica:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, **gw.env} if gw.env else None
    child = start(f"{kind}-{suffix}", sidecar_command(
        kind, "--config", gw.config_path, "--port", str(port), "--metrics-port",
        str(metrics_port)), env=env,
        log_path=os.path.join(gw.workdir, f"{kind}-{suffix}.log") if gw.capture_logs else None)
    wait_tcp("127.0.0.1", port, 30, child)
    return Replica(f"{kind}-{suffix}", port, metrics_port, child)


def add_to_envoy(gw: Gateway, replicas: list[tuple[str, Replica]]) -> None:
    """Add each ``(kind, replica)`` as an endpoint of its gRPC cluster; restart Envoy."""
    path = os.path.join(gw.workdir, "envoy.yaml")
    with open(path, encoding="utf-8") as handle:
        bootstrap = yaml.safe_load(handle)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for kind, replica in replicas:
        endpoints = clusters[CLUSTER_OF[kind]]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        endpoints.append({"endpoint": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": replica.port}}}})
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(bootstrap, handle)
    gw.restart("envoy")
    try:
        wait_http_ok(f"{gw.admin_url}/ready", 30)
    except TimeoutError:
        import urllib.request

        with urllib.request.urlopen(f"{gw.admin_url}/clusters", timeout=5) as resp:
            clusters = resp.read().decode()
        raise AssertionError(f"Envoy not ready after restart:\n{clusters[-4000:]}") from None


@dataclass
class ResettingPod:
    """Accepts a connection, reads the request, and resets it without answering: a vLLM pod
    that died mid-request. Counts the requests that reached it."""

    port: int = field(default_factory=free_port)
    requests: int = 0
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None

    def start(self) -> ResettingPod:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError):
                conn.settimeout(2)
                data = conn.recv(65536)
                if data.startswith((b"POST", b"GET")) and b" /health" not in data[:40]:
                    self.requests += 1
                # SO_LINGER 0: close with a RST, as a crashed process's kernel would.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
