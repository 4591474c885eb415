"""``python -m bench.ratelimit_python``: the Python a rate-limit decision costs, stage by stage.

One admission as the gateway sends it (bench/front.py's routing YAML: requests and tokens limits
on api_key, tenant and model, so 6 descriptors, 3 with a lease and a reservation), through
the service's own functions with no I/O: parse (upb) and ``request_from_proto`` (the reference
reading), ``request_from_bytes`` (what the service runs), ``plan`` (matching afresh, and with the
:class:`~ratelimit.limiter.Matches` a Limiter keeps), ``resolve``, ``response_to_proto`` and its
serialisation (the reference), ``response_bytes`` (what the service runs); then the whole call as
the servicer runs it, from the request's bytes to the answer's (``request_from_bytes``, the
Limiter with its guarded store, ``response_bytes``) over a store that answers at once. And one
settlement batch as extproc sends it (20 requests x 3 token descriptors, each with a lease and
the tokens used): reading it, ``plan`` and the whole call. CPU time per call
(``time.process_time``), the minimum of the rounds: on a shared machine the minimum is the
better guide to what code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from types import MappingProxyType
from typing import Any, cast

from envoy.service.ratelimit.v3 import rls_pb2

from bench import bodies, front
from ratelimit.bucket import BucketResult, Hit, Settle
from ratelimit.descriptors import RateLimitConfig
from ratelimit.from_routing import compile_rate_limits
from ratelimit.limiter import Limiter, Matches, plan, resolve
from ratelimit.metrics import RateLimitMetrics
from ratelimit.request_bytes import request_from_bytes
from ratelimit.rls_pb import request_from_proto, response_bytes, response_to_proto
from ratelimit.service import RateLimitServicer
from ratelimit.shielded_store import ShieldedStore
from ratelimit.store import StoreResult
from routing.ratelimits import DOMAIN
from sidecar_runtime.h2grpc import Context
from sidecar_runtime.wire.names import DONE_ENTRY, LEASE_ENTRY, USED_ENTRY

SETTLED_REQUESTS = 20
"""Requests per settlement batch (extproc sends up to 256 descriptors a call)."""
_LEVELS = (("api_key", "k_0123456789abcdef01234567"), ("tenant", "acme"), ("model", bodies.MODEL))


def _config() -> RateLimitConfig:
    config = front.bench_config()
    return RateLimitConfig(MappingProxyType({DOMAIN: compile_rate_limits(config)}))


def admission() -> bytes:
    """The serialised RLS request of one admission (requests, then tokens, per level)."""
    message = rls_pb2.RateLimitRequest(domain=DOMAIN)
    for kind in ("requests", "tokens"):
        for level, value in _LEVELS:
            descriptor = message.descriptors.add()
            for key, text in (("kind", kind), (level, value)):
                entry = descriptor.entries.add()
                entry.key, entry.value = key, text
            if kind == "tokens":
                entry = descriptor.entries.add()
                entry.key, entry.value = LEASE_ENTRY, "0123456789abcdef01234567"
                descriptor.hits_addend.value = 120
    raw: bytes = message.SerializeToString()
    return raw


def settlement_batch() -> bytes:
    """The serialised RLS request of one settlement batch from extproc: per request, the token
    descriptor of each level with its lease, the tokens used and the done mark."""
    message = rls_pb2.RateLimitRequest(domain=DOMAIN)
    for n in range(SETTLED_REQUESTS):
        for level, value in _LEVELS:
            descriptor = message.descriptors.add()
            for key, text in (("kind", "tokens"), (level, value),
                              (LEASE_ENTRY, f"{n:08d}89abcdef01234567"), (USED_ENTRY, "97"),
                              (DONE_ENTRY, "1")):
                entry = descriptor.entries.add()
                entry.key, entry.value = key, text
            descriptor.hits_addend.value = 0
    raw: bytes = message.SerializeToString()
    return raw


class _InstantStore:
    """A bucket store that admits at once (no I/O): what is left is the service's Python."""

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        return StoreResult(True, tuple(BucketResult(True, 100.0) for _ in hits))

    async def settle(self, settles: Sequence[Settle]) -> None:
        return None

    async def connect(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _whole_call(config: RateLimitConfig) -> Callable[[bytes], Awaitable[bytes]]:
    """One ``ShouldRateLimit`` as the servicer runs it, bytes in and out, the guarded store's
    deadline, breaker and metrics included (the context is used only to refuse a call)."""
    metrics = RateLimitMetrics()
    limiter = Limiter(lambda: config, ShieldedStore(_InstantStore(), 0.05, 1.0, metrics), metrics)
    servicer = RateLimitServicer(limiter)

    async def call(raw: bytes) -> bytes:
        return await servicer.should_rate_limit(raw, cast(Context, None))

    return call


def _time(fn: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e6


def _time_async(fn: Callable[[], Awaitable[object]], calls: int, rounds: int) -> float:
    async def timed() -> float:
        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(calls):
                await fn()
            best = min(best, (time.process_time() - started) / calls)
        return best * 1e6

    return asyncio.run(timed())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ratelimit_python",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config, raw, matches = _config(), admission(), Matches()
    message = rls_pb2.RateLimitRequest.FromString(raw)
    request = request_from_proto(message)
    planned = plan(config, request, matches)
    stored = StoreResult(True, tuple(BucketResult(True, 100.0) for _ in planned.hits))
    outcome = resolve(planned, stored)
    call = _whole_call(config)
    batch_raw = settlement_batch()
    batch = rls_pb2.RateLimitRequest.FromString(batch_raw)
    batch_request = request_from_proto(batch)
    settles = plan(config, batch_request, matches).settles
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("parse (upb)", lambda: rls_pb2.RateLimitRequest.FromString(raw)),
        ("request_from_proto", lambda: request_from_proto(message)),
        ("request_from_bytes", lambda: request_from_bytes(raw)),
        ("plan, matched afresh", lambda: plan(config, request)),
        ("plan, remembered matches", lambda: plan(config, request, matches)),
        ("resolve", lambda: resolve(planned, stored)),
        ("response_to_proto + serialise", lambda: response_to_proto(outcome).SerializeToString()),
        ("response_bytes", lambda: response_bytes(outcome)),
        ("whole call, instant store", lambda: call(raw)),
        ("settlement batch: request_from_proto", lambda: request_from_proto(batch)),
        ("settlement batch: request_from_bytes", lambda: request_from_bytes(batch_raw)),
        ("settlement batch: plan", lambda: plan(config, batch_request, matches)),
        ("settlement batch: whole call", lambda: call(batch_raw)),
    ]
    print(f"one admission: {len(message.descriptors)} descriptors, {len(planned.hits)} buckets; "
          f"one settlement batch: {len(batch.descriptors)} descriptors, {len(settles)} settles")
    print("| stage | µs CPU per call (min of rounds) |\n|---|---|")
    for name, fn in stages:
        # The whole call is a coroutine (the guarded store's deadline needs a running loop).
        timed = _time_async if "whole call" in name else _time
        print(f"| {name} | {timed(fn, args.calls, args.rounds):.1f} |")


if __name__ == "__main__":
    main()
