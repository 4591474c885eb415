"""``llm-sidecar ratelimit``: flags and the process entry point (the CLI lives in llm_sidecar)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import uvloop

from llm_sidecar.settings import Settings
from ratelimit.document import parse_yaml
from ratelimit.errors import ConfigError
from ratelimit.loader import is_routing_yaml
from ratelimit.service import serve
from routing.units import UNIX_PREFIX

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


def default_address(config_path: str) -> tuple[str, int]:
    """``services.ratelimit`` of a routing YAML (``host:port``, or ``unix:/path`` as
    ``("unix:/path", 0)``), else ``127.0.0.1:50052``."""
    path = Path(config_path)
    if not path.is_file():
        return DEFAULT_HOST, DEFAULT_PORT
    doc = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    if not is_routing_yaml(doc):
        return DEFAULT_HOST, DEFAULT_PORT
    services = doc.data.get("services")
    address = services.get("ratelimit") if isinstance(services, dict) else None
    if isinstance(address, str) and address.startswith(UNIX_PREFIX):
        return address, 0  # a Unix socket: unix:/path
    if not isinstance(address, str) or ":" not in address:
        return DEFAULT_HOST, DEFAULT_PORT
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise doc.error(("services", "ratelimit"), f"bad address '{address}'")
    return host.strip("[]") or DEFAULT_HOST, int(port)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM, stop gracefully; 0, or 1 for a bad config."""
    try:
        host, port = default_address(args.config)
    except (ConfigError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    host = args.host if args.host is not None else host
    port = args.port if args.port is not None else port

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(args.config, host, port, args.metrics_port, settings, stop)

    try:
        # uvloop: about 5% less CPU per rate-limit call than asyncio's own loop (bench/README.md).
        uvloop.run(main())
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0
