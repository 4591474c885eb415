"""extproc's own calls to the rate-limit service: checks for requests it answers itself, and
batches of token settlements (:mod:`extproc.settlements`).

One gRPC channel per process, to ``services.ratelimit`` (TLS from ``services.tls``), opened on
the first call and replaced when a reload names another address or other TLS files; the old one
closes once the calls in flight on it are past their deadline. The channel is our own HTTP/2
client (:mod:`sidecar_runtime.h2grpc.client`): grpc.aio's cost extproc about 1 ms of CPU per
call and kept grpcio's poller threads alive
(docs/decisions/0001-own-http2-server.md). A check never raises and never waits past the check's deadline
(``services.ratelimit_timeout_s``): a refused connection, an error or a missed deadline is an
``unavailable`` verdict, and the caller applies the failure policy Envoy's filter has.
"""

from __future__ import annotations

import asyncio

from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry, Counter

from extproc.actions import Descriptor, RateCheck, Verdict
from extproc.adapters import rls_pb
from routing.schema import ServicesSection, ServicesTls
from sidecar_runtime.h2grpc.client import Channel, tls_client_context
from sidecar_runtime.h2grpc.status import RpcError
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.adapters.rls_client")
UNAVAILABLE = Verdict("unavailable")
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
_parse = rls_pb2.RateLimitResponse.FromString


def _channel(target: str, tls: ServicesTls | None) -> Channel:
    """A channel with the same files Envoy uses to reach the services (``services.tls``).
    Raises ``OSError`` when they cannot be read, ``ValueError`` for a target it cannot use."""
    if tls is None:
        return Channel(target)
    context = tls_client_context(tls.ca_file, tls.cert_file, tls.key_file)
    return Channel(target, tls=context, server_name=tls.server_name)


class RateLimitClient:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._channel: Channel | None = None
        self._target: str | None = None
        self._tls: ServicesTls | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._checks = Counter(
            "llm_sidecar_extproc_ratelimit_checks",
            "Rate-limit checks extproc made itself (embedding cache hits), by verdict.",
            ["result"], registry=registry)

    def _channel_for(self, target: str, tls: ServicesTls | None, timeout_s: float) -> Channel:
        if self._channel is None or target != self._target or tls != self._tls:
            fresh = _channel(target, tls)
            old, self._channel, self._target, self._tls = self._channel, fresh, target, tls
            if old is not None:
                # Calls in flight on the old address finish within their deadline.
                asyncio.get_running_loop().call_later(timeout_s + 1, self._close_later, old)
        return self._channel

    def _close_later(self, channel: Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def check(self, check: RateCheck) -> Verdict:
        answer = await self._call(check.target, check.tls, check.timeout_s,
                                  rls_pb.request(check))
        if isinstance(answer, str):
            log.warning("extproc_ratelimit_unavailable", target=check.target, reason=answer)
            verdict = UNAVAILABLE
        else:
            verdict = rls_pb.verdict(answer)
        self._checks.labels(verdict.result).inc()
        return verdict

    async def settle(self, services: ServicesSection, descriptors: tuple[Descriptor, ...]) -> bool:
        """One call settling ``descriptors`` (a batch of :mod:`extproc.settlements`) at the
        current ``services.ratelimit`` (a reload that moves it is followed, as for checks);
        True when the service answered OK. Never raises, never waits past the deadline."""
        answer = await self._call(services.ratelimit, services.tls, services.ratelimit_timeout_s,
                                  rls_pb.settle_payload(descriptors))
        if isinstance(answer, str):
            log.debug("extproc_settlement_unanswered", target=services.ratelimit, reason=answer)
            return False
        return rls_pb.verdict(answer).result == "ok"

    async def _call(self, target: str, tls: ServicesTls | None, timeout_s: float,
                    request: bytes) -> rls_pb2.RateLimitResponse | str:
        """The service's answer, or why there is none (never raises)."""
        try:
            channel = self._channel_for(target, tls, timeout_s)
            return await channel.unary_unary(METHOD, request, _parse, timeout_s)
        except (RpcError, OSError, ValueError) as exc:
            return exc.code.name if isinstance(exc, RpcError) else str(exc)

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.aclose()
            self._channel = self._target = self._tls = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
