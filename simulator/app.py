"""The aiohttp application of one simulator: routes, error mapping, journal, ``x-sim-name``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /dcgm/metrics`` (unless
``config.dcgm`` is off), and the simulator-only ``GET``/``DELETE /sim/requests`` and
``GET``/``POST /sim/state``. Every response, errors and event streams included, carries
``x-sim-name: <name>``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar_runtime.process.logs import get_logger
from simulator import handlers
from simulator.config import SimConfig
from simulator.dcgm import DcgmExporter
from simulator.engine import Engine
from simulator.errors import SimError, internal_error, route_error
from simulator.journal import RequestJournal, header_dict
from simulator.metrics import SimMetrics
from simulator.state import STATE, SimState
from simulator.tokens import FileTokenizer, TextTokenizer

SIM_NAME_HEADER = "x-sim-name"

# Long-context pools take prompts of tens of thousands of tokens and embedding batches can be
# large; aiohttp's 1 MiB default would refuse them before vLLM's own limits apply.
_MAX_BODY_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(config: SimConfig) -> web.Application:
    """A ready-to-serve app for ``config``; ``ValueError`` if its tokenizer cannot be loaded."""
    tokenizer: TextTokenizer | None = (
        FileTokenizer(config.tokenizer) if config.tokenizer is not None else None
    )
    metrics = SimMetrics(config.served_name, config.engine)
    state = SimState(
        config=config,
        tokenizer=tokenizer,
        metrics=metrics,
        journal=RequestJournal(),
        engine=Engine(config, metrics),
        created=int(time.time()),
        dcgm=DcgmExporter(),
    )
    app = web.Application(
        middlewares=[_errors, _journal],
        client_max_size=_MAX_BODY_BYTES,
    )
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/embeddings", handlers.embeddings_endpoint)
    app.router.add_get("/v1/models", handlers.models, allow_head=False)
    app.router.add_get("/health", handlers.health, allow_head=False)
    app.router.add_get("/metrics", handlers.metrics, allow_head=False)
    app.router.add_get("/sim/requests", handlers.list_requests, allow_head=False)
    app.router.add_delete("/sim/requests", handlers.clear_requests)
    app.router.add_get("/sim/state", handlers.get_state, allow_head=False)
    app.router.add_post("/sim/state", handlers.set_state)
    if config.dcgm:
        app.router.add_get("/dcgm/metrics", handlers.dcgm_metrics, allow_head=False)
    app.on_response_prepare.append(_stamp_name)
    app.on_shutdown.append(_fast_forward)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map refusals to vLLM's error body and unknown routes to FastAPI's; never a bare 500 page."""
    try:
        return await handler(request)
    except SimError as exc:
        return handlers.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = handlers.json_response(route_error(exc.reason), status=exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        get_logger("simulator").exception("simulator_handler_failed", path=request.path)
        error = internal_error()
        return handlers.json_response(error.body(), status=error.status)


@web.middleware
async def _journal(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record every ``/v1/*`` request, decoding its body once for the handler to reuse."""
    if request.path.startswith("/v1/"):
        parsed = None
        if request.body_exists:
            parsed = handlers.parse_body(await request.read())
            request[handlers.BODY] = parsed
        request.app[STATE].journal.record(
            request.method,
            request.path,
            request.query,
            header_dict(request.headers.items()),
            parsed.value if parsed is not None else None,
        )
    return await handler(request)


async def _stamp_name(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[SIM_NAME_HEADER] = request.app[STATE].config.name


async def _fast_forward(app: web.Application) -> None:
    app[STATE].engine.stop()
