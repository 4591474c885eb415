"""The small HTTP server each service runs beside gRPC: ``/metrics`` and ``/healthz``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def start_ops_server(host: str, port: int, registry: CollectorRegistry,
                           healthy: Callable[[], bool],
                           text_pages: dict[str, Callable[[Mapping[str, str]], str]] | None = None,
                           unix_path: str | None = None) -> web.AppRunner:
    """Serve metrics and health on ``host:port`` (both services); the caller awaits
    ``runner.cleanup()``, and :func:`bound_port` says the port (``port`` 0: one the system
    chose). ``/healthz``: 200 ``{"status": "ok"}`` while ``healthy()``, else 503
    ``{"status": "unavailable"}`` (as the ``--workers`` supervisor answers).

    ``text_pages`` adds plain-text pages (path → function of the query producing the text).
    ``unix_path``: listen there instead (a worker under ``--workers``, scraped by its
    supervisor, which owns the port).
    """

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok = healthy()
        return web.json_response({"status": "ok" if ok else "unavailable"},
                                 status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    for path, produce in (text_pages or {}).items():
        app.router.add_get(path, _text_page(produce))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await listen(runner, host, port, unix_path)
    return runner


def bound_port(runner: web.AppRunner, port: int) -> int:
    """The TCP port ``runner`` listens on (``port`` itself on a Unix socket)."""
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    return port


async def listen(runner: web.AppRunner, host: str, port: int, unix_path: str | None) -> None:
    """Start ``runner`` on ``host:port``, or on the Unix socket ``unix_path`` when given."""
    if unix_path is not None:
        await web.UnixSite(runner, unix_path).start()
    else:
        await web.TCPSite(runner, host, port, reuse_address=True).start()


def _text_page(
    produce: Callable[[Mapping[str, str]], str],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def page(request: web.Request) -> web.Response:
        try:
            text = produce(request.query)
        except ValueError as exc:
            return web.Response(status=400, text=f"{exc}\n")
        return web.Response(text=text + "\n")

    return page
