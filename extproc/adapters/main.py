"""``llm-sidecar extproc``: flags, and what ext_proc brings to the process skeleton
(:mod:`sidecar_runtime.process.service_process`): its default address, its ``/canary`` page."""

from __future__ import annotations

import argparse

from extproc.adapters.service import ExtprocService, canary_text
from routing.errors import ConfigError
from routing.loader import load_config
from routing.units import parse_service_address
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.service_process import ServiceCommand, run_service
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.workers import add_worker_arguments

log = get_logger("extproc")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="routing YAML")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: the host under services.extproc)")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (default: the port under services.extproc)")
    parser.add_argument("--metrics-port", type=int, default=9101,
                        help="HTTP port for /metrics and /healthz (default 9101)")
    add_worker_arguments(parser)


def default_address(config_path: str) -> tuple[str, int]:
    """``services.extproc`` of the routing YAML (which is checked whole on the way)."""
    return parse_service_address(load_config(config_path).services.extproc)


def warn_memory_cache(config_path: str, settings: Settings, workers: int) -> None:
    if settings.redis_url is None:
        log.warning("extproc_workers_memory_cache", workers=workers,
                    detail="no LLM_SIDECAR_REDIS_URL: every worker keeps its own embedding "
                           "cache (up to LLM_SIDECAR_CACHE_MEMORY_BYTES each), so hits are "
                           "rarer; set a Redis URL to share one")


COMMAND = ServiceCommand(
    name="extproc",
    default_address=default_address,
    build=ExtprocService,
    config_errors=(ConfigError, OSError),  # a port in use too: one line, as ratelimit
    preflight=warn_memory_cache,
    supervisor_pages={"/canary": canary_text},
)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return run_service(COMMAND, args, settings)
