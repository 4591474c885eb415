"""HTTP ``/metrics`` (Prometheus text) and ``/healthz`` for the ratelimit process."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ratelimit.metrics import RateLimitMetrics
from sidecar_runtime.ops_http import listen


def make_app(metrics: RateLimitMetrics, healthy: Callable[[], bool]) -> web.Application:
    async def metrics_handler(_: web.Request) -> web.Response:
        response = web.Response(body=metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def healthz(_: web.Request) -> web.Response:
        if healthy():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not serving\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    return app


async def start_admin(
    host: str, port: int, metrics: RateLimitMetrics, healthy: Callable[[], bool],
    unix_path: str | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the admin app (on ``unix_path`` instead of ``host:port`` when given: a worker
    under ``--workers``); returns the runner (to clean up) and the bound port."""
    runner = web.AppRunner(make_app(metrics, healthy), access_log=None)
    await runner.setup()
    await listen(runner, host, port, unix_path)
    addresses = runner.addresses
    bound = int(addresses[0][1]) if addresses and unix_path is None else port
    return runner, bound
