"""``llm-sidecar ratelimit``: flags and the process entry point (the CLI lives in llm_sidecar)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import uvloop

from ratelimit.errors import ConfigError
from ratelimit.loader import is_routing_yaml, load_path, read_config
from ratelimit.service import serve
from routing.units import parse_service_address
from sidecar_runtime.grpc_listen import metrics_host
from sidecar_runtime.logs import bind_worker
from sidecar_runtime.procs import sidecar_command
from sidecar_runtime.settings import Settings
from sidecar_runtime.signals import install_stop_handlers
from sidecar_runtime.workers import add_worker_arguments, supervise, workers_problem

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help="routing YAML, envoyproxy/ratelimit descriptor file, or a directory of them",
    )
    parser.add_argument(
        "--host",
        default=None,
        help=f"gRPC (and metrics) listen address (default: services.ratelimit of a routing "
        f"YAML, else {DEFAULT_HOST})",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"gRPC port (default: services.ratelimit of a routing YAML, else {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"HTTP /metrics and /healthz port (default {DEFAULT_METRICS_PORT})",
    )
    add_worker_arguments(parser)


def default_address(config_path: str) -> tuple[str, int]:
    """``services.ratelimit`` of a routing YAML (``host:port``, or ``unix:/path`` as
    ``("unix:/path", 0)``), else ``127.0.0.1:50052``. Only the address is read here: a wrong
    one gives the default, and the config load that follows reports it with every other
    problem of the file, as ``llm-sidecar check`` does."""
    path = Path(config_path)
    if not path.is_file():
        return DEFAULT_HOST, DEFAULT_PORT
    doc = read_config(path)
    if not is_routing_yaml(doc):
        return DEFAULT_HOST, DEFAULT_PORT
    services = doc.data.get("services")
    address = services.get("ratelimit") if isinstance(services, dict) else None
    try:
        return parse_service_address(address) if isinstance(address, str) else (
            DEFAULT_HOST, DEFAULT_PORT)
    except ValueError:
        return DEFAULT_HOST, DEFAULT_PORT


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM, stop gracefully; 0, or 1 for a bad config."""
    try:
        host, port = default_address(args.config)
    except (ConfigError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    host = args.host if args.host is not None else host
    port = args.port if args.port is not None else port
    if args.worker_ops_socket is not None:
        bind_worker(args.worker_index)
    else:
        workers = args.workers if args.workers is not None else settings.workers
        if workers != 1:
            return run_workers(args, settings, workers, host, port)

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_handlers(stop)
        await serve(args.config, host, port, args.metrics_port, settings, stop,
                    args.worker_ops_socket)

    try:
        # uvloop: about 5% less CPU per rate-limit call than asyncio's own loop (bench/README.md).
        uvloop.run(main())
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


def run_workers(args: argparse.Namespace, settings: Settings, workers: int, host: str,
                port: int) -> int:
    """``--workers N``: N processes on one port under a supervisor (sidecar_runtime.workers).
    Refused without Redis: each worker's memory buckets would admit N times the limit."""
    problem = workers_problem("ratelimit", workers, host, port,
                              needs_shared_store=settings.redis_url is None)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        load_path(args.config)  # a bad config: one clear error, not N workers failing
    except (ConfigError, OSError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    base = ["ratelimit", "--config", args.config, "--host", host, "--port", str(port)]
    return supervise(
        "ratelimit", workers,
        lambda index, socket: sidecar_command(*base, "--worker-ops-socket", socket,
                                              "--worker-index", str(index)),
        (host, port), (metrics_host(host), args.metrics_port), settings.shutdown_grace_s)
