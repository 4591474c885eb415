"""extproc's own calls to the rate-limit service: checks for requests it answers itself, and
batches of token settlements (:mod:`extproc.settlements`).

One gRPC channel per process, to ``services.ratelimit``, opened on the first check and replaced
when a reload names another address. A check never raises and never waits past the check's
deadline (``services.ratelimit_timeout_s``): a refused connection, an error or a missed deadline
is an ``unavailable`` verdict, and the caller applies the failure policy Envoy's filter has.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from extproc import rls_wire
from extproc.actions import Descriptor, RateCheck, Verdict
from routing.schema import ServicesSection, ServicesTls
from sidecar_runtime.logs import get_logger

log = get_logger("extproc.rls_client")
UNAVAILABLE = Verdict("unavailable")


def _credentials(tls: ServicesTls) -> grpc.ChannelCredentials:
    """The same files Envoy uses to reach the services (``services.tls``)."""
    roots = Path(tls.ca_file).read_bytes()
    key = Path(tls.key_file).read_bytes() if tls.key_file else None
    chain = Path(tls.cert_file).read_bytes() if tls.cert_file else None
    return grpc.ssl_channel_credentials(roots, key, chain)


class RateLimitClient:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._stub: rls_pb2_grpc.RateLimitServiceStub | None = None
        self._key: tuple[str, str] | None = None
        self._checks = Counter(
            "llm_sidecar_extproc_ratelimit_checks",
            "Rate-limit checks extproc made itself (embedding cache hits), by verdict.",
            ["result"], registry=registry)

    def _stub_for(self, target: str, tls: ServicesTls | None,
                  timeout_s: float) -> rls_pb2_grpc.RateLimitServiceStub:
        key = (target, tls.model_dump_json() if tls else "")
        if self._stub is None or key != self._key:
            old = self._channel
            if old is not None:
                # Calls in flight on the old address finish within their deadline.
                asyncio.get_running_loop().call_later(
                    timeout_s + 1, lambda: asyncio.ensure_future(old.close()))
            if tls is None:
                self._channel = grpc.aio.insecure_channel(target)
            else:
                options = [("grpc.ssl_target_name_override", tls.server_name)] \
                    if tls.server_name else []
                self._channel = grpc.aio.secure_channel(target, _credentials(tls), options)
            self._stub = rls_pb2_grpc.RateLimitServiceStub(self._channel)
            self._key = key
        return self._stub

    async def check(self, check: RateCheck) -> Verdict:
        try:
            stub = self._stub_for(check.target, check.tls, check.timeout_s)
            response = await stub.ShouldRateLimit(rls_wire.request(check),
                                                  timeout=check.timeout_s)
            verdict = rls_wire.verdict(response)
        except (grpc.aio.AioRpcError, OSError) as exc:
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("extproc_ratelimit_unavailable", target=check.target, reason=reason)
            verdict = UNAVAILABLE
        self._checks.labels(verdict.result).inc()
        return verdict

    async def settle(self, services: ServicesSection, descriptors: tuple[Descriptor, ...]) -> bool:
        """One call settling ``descriptors`` (a batch of :mod:`extproc.settlements`) at the
        current ``services.ratelimit`` (a reload that moves it is followed, as for checks);
        True when the service answered OK. Never raises, never waits past the deadline."""
        try:
            stub = self._stub_for(services.ratelimit, services.tls, services.ratelimit_timeout_s)
            response = await stub.ShouldRateLimit(rls_wire.settle_request(descriptors),
                                                  timeout=services.ratelimit_timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.debug("extproc_settlement_unanswered", target=services.ratelimit, reason=reason)
            return False
        return rls_wire.verdict(response).result == "ok"

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._key = None
