"""LiteLLM's proxy (``litellm[proxy]`` from PyPI) as the comparison gateway.

Streamed workloads reach LiteLLM's model for each paced pool, pointed at the same paced server
the gateway routes to. It gets its own virtualenv, ``bench/.venv-litellm`` (gitignored), created on the first
``--with-litellm`` run, so its many pinned dependencies never touch the project's venv. It is
pointed at the same stand-in upstream, with the deployment's ``rpm``/``tpm`` limits tracked in
Redis (``router_settings.redis_*``: LiteLLM's way to share rate limits across instances) and
limits no run reaches, one uvicorn worker (its default), a master key and no database.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from bench import bodies
from bench.paced import POOLS
from bench.stack import START_TIMEOUT_S, Shared, spawn
from sidecar_runtime.process.procs import Child, free_port, wait_http_ok

VENV = Path(__file__).resolve().parent / ".venv-litellm"
PACKAGE = "litellm[proxy]"
MASTER_KEY = "sk-" + "0123456789abcdef" * 4
"""A master key as LiteLLM wants one in production; clients send it as their bearer token."""


def executable() -> Path:
    return VENV / "bin" / "litellm"


def ensure_installed(log: bool = True) -> str:
    """Create the venv and install LiteLLM when missing; the installed version."""
    if not executable().exists():
        if log:
            print(f"bench: installing {PACKAGE} into {VENV} (one time, a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", PACKAGE], check=True)
    done = subprocess.run([str(VENV / "bin" / "python"), "-c",
                           "from importlib.metadata import version; print(version('litellm'))"],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _deployment(model: str, port: int) -> dict[str, object]:
    return {
        "model_name": model,
        "litellm_params": {
            "model": f"openai/{model}",
            "api_base": f"http://127.0.0.1:{port}/v1",
            "api_key": "none",
            "rpm": 100_000_000,
            "tpm": 100_000_000_000,
        },
    }


def config(upstream_port: int, redis_port: int,
           paced_ports: dict[str, int] | None = None) -> dict[str, object]:
    """The chat model on the stand-in upstream and, as the gateway routes them, each paced
    pool's model on its paced server (``paced_ports``: port by cluster)."""
    ports = paced_ports or {}
    return {
        "model_list": [_deployment(bodies.MODEL, upstream_port),
                       *[_deployment(pool.model, ports[pool.cluster])
                         for pool in POOLS if pool.cluster in ports]],
        "router_settings": {
            "routing_strategy": "usage-based-routing-v2",
            "redis_host": "127.0.0.1",
            "redis_port": redis_port,
        },
        "litellm_settings": {"telemetry": False, "num_retries": 0},
        "general_settings": {"master_key": MASTER_KEY},
    }


@contextlib.contextmanager
def proxy(env: Shared) -> Iterator[tuple[str, list[Child]]]:
    """LiteLLM on a free port; yields its base URL and its process."""
    port = free_port()
    path = os.path.join(env.workdir, "litellm.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config(env.upstream_port, env.redis_port, env.paced_ports), handle,
                       sort_keys=False)
    child = spawn("litellm", [str(executable()), "--config", path, "--host", "127.0.0.1",
                              "--port", str(port), "--num_workers", "1"], env.workdir,
                  env={"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health/liveliness", START_TIMEOUT_S * 3, child)
        yield f"http://127.0.0.1:{port}", [child]
    finally:
        child.stop()
