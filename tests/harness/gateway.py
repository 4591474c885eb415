"""A whole gateway for end-to-end tests: real Envoy, extproc, simulators, on free ports.

It runs the same code as ``llm-sidecar up`` (``start_all``), with a config the test writes.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml

from llm_sidecar.up import start_all, stop_all
from routing.loader import load_config
from sidecar_runtime.process.procs import Child, envoy_binary, free_port, start
from tests.harness.ci import unavailable


@dataclass
class Gateway:
    url: str
    """Envoy's listener, e.g. ``http://127.0.0.1:PORT``."""
    admin_url: str
    config_path: str
    workdir: str
    sims: dict[str, str]
    """Cluster name → simulator base URL."""
    extproc_metrics: str
    ratelimit_metrics: str
    children: list[Child]
    env: dict[str, str] | None = None
    """What extproc and ratelimit were started with (a restart uses it again)."""
    capture_logs: bool = False

    @property
    def openai_base(self) -> str:
        return f"{self.url}/v1"

    def sim_requests(self, cluster: str) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.sims[cluster]}/sim/requests", timeout=5) as resp:
            result: list[dict[str, Any]] = json.loads(resp.read())
        return result

    def clear_sims(self) -> None:
        for url in self.sims.values():
            request = urllib.request.Request(f"{url}/sim/requests", method="DELETE")
            with urllib.request.urlopen(request, timeout=5):
                pass

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str) -> Child:
        """Start ``name`` (``extproc`` or ``ratelimit``) again with the same command line and
        environment, after stopping it if it still runs; the caller waits for it to be ready."""
        old = self.child(name)
        old.stop()
        env = {**os.environ, **self.env} if self.env else None
        log_path = os.path.join(self.workdir, f"{name}.log") if self.capture_logs else None
        args = old.process.args
        assert isinstance(args, list)
        new = start(name, [str(arg) for arg in args], env=env, log_path=log_path)
        self.children[self.children.index(old)] = new
        return new

    def logs(self) -> str:
        """Everything the processes logged so far (with ``capture_logs=True``)."""
        parts = []
        for name in sorted(os.listdir(self.workdir)):
            if name.endswith(".log"):
                with open(os.path.join(self.workdir, name), encoding="utf-8",
                          errors="replace") as handle:
                    parts.append(handle.read())
        return "\n".join(parts)


def ip(port: int) -> str:
    """``127.0.0.1:PORT``: a pod, service or listener address of a test config."""
    return f"127.0.0.1:{port}"


def envoy_counter(admin_url: str, pattern: str) -> int:
    """The sum of Envoy's counters whose name matches the regex ``pattern`` (0 before any was
    counted), read from the admin interface at ``admin_url`` (``http://host:port``)."""
    with urllib.request.urlopen(f"{admin_url}/stats?filter={pattern}", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(int(line.rsplit(": ", 1)[1]) for line in lines if ": " in line)


def default_doc() -> dict[str, Any]:
    """The example config's shape, every port free, every pool a simulator."""
    def ep() -> list[str]:
        return [f"127.0.0.1:{free_port()}"]

    fast = {"decode_ms_per_token": 0.2}

    return {
        "version": 1,
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
        # A generous rate-limit timeout: on a loaded test machine a slow decision must not
        # turn into a fail-open admit that a limit test would read as a missing 429.
        "services": {"extproc": f"127.0.0.1:{free_port()}",
                     "ratelimit": f"127.0.0.1:{free_port()}", "ratelimit_timeout_s": 2.0},
        "clusters": {
            "vllm-short": {"endpoints": ep(), "max_context": 2048, "simulate": True},
            "vllm-long": {"endpoints": ep(), "max_context": 32768, "simulate": fast},
            "vllm-canary": {"endpoints": ep(), "max_context": 32768, "simulate": fast},
            "embed": {"endpoints": ep(), "max_context": 8192, "simulate": True},
        },
        "models": {
            "llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "default_max_tokens": 256},
            "bge-m3": {"kind": "embedding", "clusters": ["embed"]},
        },
    }


@contextmanager
def running_gateway(doc: dict[str, Any], workdir: str, *, env: dict[str, str] | None = None,
                    capture_logs: bool = False) -> Iterator[Gateway]:
    """Start the gateway for ``doc`` in ``workdir``; stop every process afterwards.

    ``env`` goes to extproc and ratelimit (e.g. ``LLM_SIDECAR_REDIS_URL``); with
    ``capture_logs`` every process logs into ``workdir`` (read them with ``Gateway.logs()``).
    """
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    if shutil.which("envoy") is None and not os.path.exists(envoy_binary()):
        unavailable("envoy")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "routing.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle, sort_keys=False)
    config = load_config(path)
    extproc_metrics, ratelimit_metrics = free_port(), free_port()
    children = start_all(config, path, workdir, extproc_metrics_port=extproc_metrics,
                         ratelimit_metrics_port=ratelimit_metrics, env=env,
                         log_dir=workdir if capture_logs else None)
    try:
        sims = {name: f"http://{spec.endpoints[0]}" for name, spec in config.clusters.items()
                if spec.simulator is not None}
        yield Gateway(
            url=f"http://{config.envoy.listen}",
            admin_url=f"http://{config.envoy.admin}",
            config_path=path,
            workdir=workdir,
            sims=sims,
            extproc_metrics=f"http://127.0.0.1:{extproc_metrics}",
            ratelimit_metrics=f"http://127.0.0.1:{ratelimit_metrics}",
            children=children,
            env=env,
            capture_logs=capture_logs,
        )
    finally:
        stop_all(children)
