"""The gRPC side: ``envoy.service.ratelimit.v3.RateLimitService`` (served by
:mod:`sidecar_runtime.h2grpc`), and what the
service brings to the process skeleton (store, limiter, config reloader); the skeleton
(:mod:`sidecar_runtime.process.service_process`) adds health, ops HTTP, reload polling and the drain.
The only module of the package that imports ``grpc``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit.descriptors import RateLimitConfig
from ratelimit.errors import ConfigError, OutOfBounds
from ratelimit.limiter import Limiter
from ratelimit.loader import load_path
from ratelimit.memory_store import MemoryStore
from ratelimit.metrics import RateLimitMetrics
from ratelimit.redis_store import RedisStore
from ratelimit.request_bytes import Unparsable, request_from_bytes
from ratelimit.rls_pb import response_bytes
from ratelimit.shielded_store import ShieldedStore
from ratelimit.store import BucketStore
from sidecar_runtime.h2grpc import Context, Server
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.service_process import Listen, ServiceProcess
from sidecar_runtime.process.settings import Settings, redis_url_for_logs
from sidecar_runtime.process.workers import LAST_GOOD_CONFIG, worker_file
from sidecar_runtime.redis.audit import audit_redis
from sidecar_runtime.redis.client import make_client

log = get_logger("ratelimit")
SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"
_MAX_WARNED_DOMAINS = 256
CONFIG_ERRORS: tuple[type[Exception], ...] = (ConfigError, OSError, ValueError)
"""What loading a descriptor config (or a routing YAML) raises when the config is bad."""


_OK_ANSWER = b"\x08\x01"
"""``RateLimitResponse(overall_code=OK)`` serialised: what a call that hit a bug answers."""


class RateLimitServicer:
    """One call: the request's bytes in, plain request, limiter decision, the answer's bytes out.

    Registered without grpc's (de)serialisers (:meth:`register`): the request is read from its
    bytes and the answer written as bytes (:mod:`ratelimit.request_bytes`,
    :func:`ratelimit.rls_pb.response_bytes`), the same on the wire as through upb, for less CPU."""

    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    def register(self, server: Server | grpc.aio.Server) -> None:
        """Serve ``ShouldRateLimit`` on ``server`` (h2grpc's, or grpc.aio's in tests)."""
        handler = grpc.unary_unary_rpc_method_handler(self.should_rate_limit)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ShouldRateLimit": handler}),))

    async def should_rate_limit(self, raw: bytes, context: Context) -> bytes:
        try:
            request = request_from_bytes(raw)
        except Unparsable as exc:
            # What h2grpc answers when a deserialiser refuses a message.
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except OutOfBounds as exc:
            # Above a bound of ratelimit.request_bounds (far above what Envoy and extproc
            # send): refused, found on the bytes before any descriptor is built, so no call
            # carries unbounded work.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:  # a bug must not turn into 500s: log it and admit
            log.exception("should_rate_limit_failed",
                          domain=rls_pb2.RateLimitRequest.FromString(raw).domain)
            return _OK_ANSWER
        try:
            # The answer too: one that cannot be written (a limit name UTF-8 cannot carry,
            # which the loader refuses) is a bug like any other.
            return response_bytes(await self._limiter.check(request))
        except Exception:  # a bug must not turn into 500s: log it and admit
            log.exception("should_rate_limit_failed", domain=request.domain)
            return _OK_ANSWER


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
    client = make_client(settings.redis_url.get_secret_value(), timeout_s)  # RedisUrlError
    log.info("ratelimit_redis_store", redis=redis_url_for_logs(settings.redis_url))
    return ShieldedStore(RedisStore(client), timeout_s, settings.redis_breaker_cooldown_ms / 1000, metrics,
                        failures_to_open=settings.redis_breaker_failures)


class RateLimitService:
    """ratelimit's part of the process skeleton (:mod:`sidecar_runtime.process.service_process`): the
    descriptor config and its reloader, the bucket store, the limiter and its servicer."""

    name = "ratelimit"
    health_name = SERVICE_NAME
    max_message_bytes = 4 * 1024 * 1024  # request_bounds.MAX_REQUEST_BYTES is below it

    def __init__(self, config_path: str, settings: Settings,
                 store: BucketStore | None = None) -> None:
        self.metrics = RateLimitMetrics()
        self.registry = self.metrics.registry
        self.ops_pages: Mapping[str, Callable[[Mapping[str, str]], str]] = {}
        self._warned: set[str] = set()
        self.reloader: Reloader[RateLimitConfig] = Reloader(
            config_path,
            load_path,
            settings.reload_interval_s,
            on_result=self._reloaded,
            errors=CONFIG_ERRORS,
            last_good=worker_file(settings.worker_dir, LAST_GOOD_CONFIG),
        )
        self.store = store if store is not None else make_store(settings, self.metrics)
        self.limiter = Limiter(self.reloader.current, self.store, self.metrics, self._unknown_domain)

    def _reloaded(self, ok: bool, _: str) -> None:
        self.metrics.reloads.labels("ok" if ok else "error").inc()

    def _unknown_domain(self, domain: str) -> None:
        if domain in self._warned or len(self._warned) >= _MAX_WARNED_DOMAINS:
            return
        self._warned.add(domain)
        log.warning("ratelimit_unknown_domain", domain=domain, detail="answered OK, not limited")

    async def open(self, server: Server) -> None:
        await self.store.connect()
        RateLimitServicer(self.limiter).register(server)

    async def close(self) -> None:
        await self.store.aclose()

    def describe(self) -> Mapping[str, Any]:
        return {"domains": sorted(self.reloader.current().domains)}


RateLimitProcess = ServiceProcess[RateLimitService]


def rate_limit_process(config_path: str, host: str, port: int, metrics_port: int,
                       settings: Settings, store: BucketStore | None = None) -> RateLimitProcess:
    """The whole ratelimit process, to start in-process (tests); ports 0 are chosen by the
    system, ``process.port`` and ``process.metrics_port`` say which."""
    return ServiceProcess(RateLimitService(config_path, settings, store),
                          Listen(host, port, metrics_port), settings)
