"""The gRPC side: ``envoy.service.ratelimit.v3.RateLimitService`` and ``grpc.health.v1`` on
grpc.aio, plus the process around them (store, reload, admin HTTP). The only module of the
package that imports ``grpc``.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from aiohttp import web
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from ratelimit.descriptors import RateLimitConfig
from ratelimit.errors import ConfigError
from ratelimit.guard import GuardedStore
from ratelimit.limiter import Limiter
from ratelimit.loader import load_path
from ratelimit.memory_store import MemoryStore
from ratelimit.metrics import RateLimitMetrics
from ratelimit.redis_store import RedisStore
from ratelimit.store import BucketStore
from ratelimit.wire import MAX_DESCRIPTORS, request_from_proto, response_to_proto
from sidecar_runtime.grpc_listen import add_port, metrics_host, reuse_port_option
from sidecar_runtime.logs import get_logger
from sidecar_runtime.ops_http import bound_port, start_ops_server
from sidecar_runtime.redis_audit import audit_redis
from sidecar_runtime.redis_client import make_client
from sidecar_runtime.reload import Reloader
from sidecar_runtime.settings import Settings, redis_url_for_logs

log = get_logger("ratelimit")
SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"
_MAX_WARNED_DOMAINS = 256


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """One call: protobuf in, plain request, limiter decision, protobuf out."""

    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        if len(request.descriptors) > MAX_DESCRIPTORS:
            # Envoy sends a handful per call and extproc's settlement batches at most 256: a
            # call above the cap is refused before any work, so none can carry unbounded work.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_DESCRIPTORS} descriptors per call")
        try:
            outcome = await self._limiter.check(request_from_proto(request))
        except Exception:  # a bug must not turn into 500s: log it and admit
            log.exception("should_rate_limit_failed", domain=request.domain)
            return rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
        return response_to_proto(outcome)


def make_store(settings: Settings, metrics: RateLimitMetrics) -> BucketStore:
    """Redis behind a deadline and a breaker when a URL is set, else process memory."""
    audit_redis(settings.redis_url, settings.dev_mode, metrics.registry, "ratelimit")
    if settings.redis_url is None:
        log.warning(
            "ratelimit_memory_store",
            detail="no LLM_SIDECAR_REDIS_URL: buckets live in this process; "
            "right for one replica, wrong for several",
        )
        return MemoryStore()
    timeout_s = settings.redis_timeout_ms / 1000
    try:
        client = make_client(settings.redis_url.get_secret_value(), timeout_s)
    except ValueError as exc:
        raise ConfigError.at("LLM_SIDECAR_REDIS_URL", 0, str(exc)) from None
    log.info("ratelimit_redis_store", redis=redis_url_for_logs(settings.redis_url))
    return GuardedStore(RedisStore(client), timeout_s, settings.redis_breaker_cooldown_ms / 1000, metrics,
                        failures_to_open=settings.redis_breaker_failures)


class RateLimitServer:
    """The whole ratelimit process, startable in-process (tests) or from :func:`serve`.

    Ports given as 0 are chosen by the OS; :attr:`port` and :attr:`metrics_port` tell which.
    """

    def __init__(
        self,
        config_path: str,
        host: str,
        port: int,
        metrics_port: int,
        settings: Settings,
        store: BucketStore | None = None,
        worker_ops_socket: str | None = None,
    ) -> None:
        self.metrics = RateLimitMetrics()
        self._worker_ops_socket = worker_ops_socket
        self.host = host
        self._settings = settings
        self.port = port
        self.metrics_port = metrics_port
        self._warned: set[str] = set()
        self.reloader: Reloader[RateLimitConfig] = Reloader(
            config_path,
            load_path,
            settings.reload_interval_s,
            on_result=self._reloaded,
            errors=(ConfigError, OSError, ValueError),
        )
        self.store = store if store is not None else make_store(settings, self.metrics)
        self.limiter = Limiter(self.reloader.current, self.store, self.metrics, self._unknown_domain)
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._serving = False
        self._tasks: list[asyncio.Task[None]] = []
        self._admin: web.AppRunner | None = None

    def _reloaded(self, ok: bool, _: str) -> None:
        self.metrics.reloads.labels("ok" if ok else "error").inc()

    def _unknown_domain(self, domain: str) -> None:
        if domain in self._warned or len(self._warned) >= _MAX_WARNED_DOMAINS:
            return
        self._warned.add(domain)
        log.warning("ratelimit_unknown_domain", domain=domain, detail="answered OK, not limited")

    async def start(self) -> None:
        # A worker of --workers N shares the port; its /metrics goes to the supervisor.
        server = grpc.aio.server(options=[reuse_port_option(self._worker_ops_socket is not None)])
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitServicer(self.limiter), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = add_port(server, self.host, self.port, self._settings)
        await server.start()
        self._server = server
        runner = await start_ops_server(
            metrics_host(self.host), self.metrics_port, self.metrics.registry,
            lambda: self._serving, unix_path=self._worker_ops_socket)
        self.metrics_port = bound_port(runner, self.metrics_port)
        self._admin = runner
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        self._tasks.append(asyncio.create_task(self.reloader.run()))
        domains = sorted(self.reloader.current().domains)
        log.info("ratelimit_serving", port=self.port, metrics_port=self.metrics_port, domains=domains)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, finish in-flight calls (up to ``grace_s``), release all."""
        self._serving = False
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        await self.store.aclose()


async def serve(
    config_path: str,
    host: str,
    port: int,
    metrics_port: int,
    settings: Settings,
    stop: asyncio.Event | None = None,
    worker_ops_socket: str | None = None,
) -> None:
    """Serve until ``stop`` is set (or the task is cancelled), then stop gracefully.

    Raises :class:`ConfigError` when the initial config is invalid. ``worker_ops_socket``:
    this process is one of ``--workers N`` (see :mod:`sidecar_runtime.workers`).
    """
    server = RateLimitServer(config_path, host, port, metrics_port, settings,
                             worker_ops_socket=worker_ops_socket)
    await server.start()
    try:
        if stop is None:
            await asyncio.Event().wait()
        else:
            await stop.wait()
    finally:
        await asyncio.shield(server.stop(settings.shutdown_grace_s))
