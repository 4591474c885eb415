"""``llm-sidecar ratelimit``: flags, and what the rate-limit service brings to the process
skeleton (:mod:`sidecar_runtime.process.service_process`): its default address, its config check."""

from __future__ import annotations

import argparse
from pathlib import Path

from ratelimit.loader import is_routing_yaml, load_path, read_config
from ratelimit.service import CONFIG_ERRORS, RateLimitService
from routing.units import parse_service_address
from sidecar_runtime.process.service_process import ServiceCommand, run_service
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.workers import add_worker_arguments

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


def check_config(config_path: str, settings: Settings, workers: int) -> None:
    """Load the config once before N workers do (a bad one: one clear error)."""
    load_path(config_path)


COMMAND = ServiceCommand(
    name="ratelimit",
    default_address=default_address,
    build=RateLimitService,
    config_errors=CONFIG_ERRORS,
    preflight=check_config,
    # Each worker's memory buckets would admit N times the limit.
    needs_shared_store=True,
)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM, stop gracefully; 0, 1 for a bad config, 2 for a
    ``--workers`` refused (without Redis, on a Unix socket)."""
    return run_service(COMMAND, args, settings)
