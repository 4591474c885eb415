"""``llm-sidecar extproc``: load the routing YAML, serve ext_proc, reload on change."""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from prometheus_client import CollectorRegistry

from extproc.service import install_stop_handlers, serve
from llm_sidecar.grpc_listen import metrics_host
from llm_sidecar.logs import get_logger
from llm_sidecar.reload import Reloader
from llm_sidecar.reload_metrics import ReloadMetrics
from llm_sidecar.settings import Settings
from routing.compiled import Snapshot, compile_config
from routing.loader import load_config
from routing.units import parse_service_address

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
        await serve(holder.current, settings, host, port, metrics_host(host), args.metrics_port,
                    registry, stop)
    finally:
        stop.set()
        await watcher
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    # uvloop: about 7% less CPU per ext_proc stream than asyncio's own loop (bench/README.md).
    return uvloop.run(main_async(args, settings))
