"""Serving a simulator on a socket: in-process for tests, or until a signal for the CLI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.signals import install_stop_handlers, remove_stop_handlers
from simulator.app import build_app
from simulator.config import SimConfig
from simulator.state import STATE

# In-flight responses are fast-forwarded on shutdown, so they end within milliseconds; this only
# bounds a client that stops reading.
_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RunningSimulator:
    """A simulator listening at ``url`` (``http://host:port``, no trailing slash)."""

    host: str
    port: int
    app: web.Application

    @property
    def url(self) -> str:
        """Base URL; the OpenAI API is under ``url + "/v1"``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def config(self) -> SimConfig:
        """The settings it runs with."""
        return self.app[STATE].config


@asynccontextmanager
async def running_simulator(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningSimulator]:
    """Serve ``config`` on ``host:port`` for the duration of the block.

    ``port=0`` binds a free port, reported by ``.port``. Leaving the block stops accepting
    connections, finishes in-flight responses without further delay, and closes the socket.
    """
    app = build_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        yield RunningSimulator(host=host, port=bound_port, app=app)
    finally:
        app[STATE].engine.stop()
        await runner.cleanup()


async def serve_until_signalled(config: SimConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""
    log = get_logger("simulator")
    stop = asyncio.Event()
    install_stop_handlers(stop)
    try:
        async with running_simulator(config, host, port) as sim:
            log.info("simulator_listening", url=sim.url, name=config.name, models=list(config.models))
            await stop.wait()
            log.info("simulator_stopping", name=config.name)
    finally:
        remove_stop_handlers()
