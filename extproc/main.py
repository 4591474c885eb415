"""``llm-sidecar extproc``: load the routing YAML, serve ext_proc, reload on change."""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvloop
from prometheus_client import CollectorRegistry

from extproc.service import canary_text, serve
from routing.compiled import Snapshot, compile_config
from routing.loader import load_config
from routing.units import parse_service_address
from sidecar_runtime.grpc_listen import metrics_host
from sidecar_runtime.logs import bind_worker, get_logger
from sidecar_runtime.procs import sidecar_command
from sidecar_runtime.reload import Reloader
from sidecar_runtime.reload_metrics import ReloadMetrics
from sidecar_runtime.settings import Settings
from sidecar_runtime.signals import install_stop_handlers
from sidecar_runtime.workers import add_worker_arguments, supervise, workers_problem

log = get_logger("extproc")


def load_snapshot(path: str) -> Snapshot:
    return compile_config(load_config(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="routing YAML")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: the host under services.extproc)")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (default: the port under services.extproc)")
    parser.add_argument("--metrics-port", type=int, default=9101,
                        help="HTTP port for /metrics and /healthz (default 9101)")
    add_worker_arguments(parser)


def listen_on(args: argparse.Namespace) -> tuple[str, int]:
    """The gRPC host and port: the flags, else ``services.extproc`` of the routing YAML."""
    host, port = parse_service_address(load_config(args.config).services.extproc)
    return args.host or host, args.port if args.port is not None else port


async def main_async(args: argparse.Namespace, settings: Settings) -> int:
    registry = CollectorRegistry()
    holder = Reloader(args.config, load_snapshot, settings.reload_interval_s,
                      ReloadMetrics(registry, "extproc"))
    host, port = parse_service_address(holder.current().config.services.extproc)
    host = args.host or host
    port = args.port if args.port is not None else port
    stop = asyncio.Event()
    install_stop_handlers(stop)
    watcher = asyncio.create_task(holder.watch(stop))
    try:
        await serve(holder, settings, host, port, metrics_host(host), args.metrics_port,
                    registry, stop, args.worker_ops_socket)
    finally:
        stop.set()
        await watcher
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.worker_ops_socket is not None:
        bind_worker(args.worker_index)
    else:
        workers = args.workers if args.workers is not None else settings.workers
        if workers != 1:
            return run_workers(args, settings, workers)
    # uvloop: about 7% less CPU per ext_proc stream than asyncio's own loop (bench/README.md).
    return uvloop.run(main_async(args, settings))


def run_workers(args: argparse.Namespace, settings: Settings, workers: int) -> int:
    host, port = listen_on(args)
    problem = workers_problem("extproc", workers, host, port, needs_shared_store=False)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if settings.redis_url is None:
        log.warning("extproc_workers_memory_cache", workers=workers,
                    detail="no LLM_SIDECAR_REDIS_URL: every worker keeps its own embedding "
                           "cache (up to LLM_SIDECAR_CACHE_MEMORY_BYTES each), so hits are "
                           "rarer; set a Redis URL to share one")
    base = ["extproc", "--config", args.config, "--host", host, "--port", str(port)]
    return supervise(
        "extproc", workers,
        lambda index, socket: sidecar_command(*base, "--worker-ops-socket", socket,
                                              "--worker-index", str(index)),
        (host, port), (metrics_host(host), args.metrics_port), settings.shutdown_grace_s,
        {"/canary": canary_text})
