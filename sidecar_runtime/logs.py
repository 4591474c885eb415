"""structlog JSON logging to stderr, one configuration for every service."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def configure(level: str = "info", service: str = "llm-sidecar") -> None:
    """Log JSON lines to stderr at ``level``; every line carries ``service``."""
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str) -> Any:
    """A structlog logger named ``name``."""
    return structlog.get_logger(name)


def bind_worker(index: int) -> None:
    """Every later line of this process also carries ``worker`` (one of ``--workers N``)."""
    structlog.contextvars.bind_contextvars(worker=index)
