"""``python -m bench.extproc_python``: the Python one non-streamed chat request costs extproc.

The four ext_proc messages Envoy sends for it (request headers, request body, response headers,
response body with usage), parsed from bytes, through :class:`extproc.adapters.service.ExternalProcessor`
(stream state, routing, telemetry with the Prometheus metrics and the JSON log line, the
settlement handed to a :class:`~extproc.settlements.SettlementBatcher`) to serialised answers,
then the stream reset as Envoy resets it; and, apart, the encoding of one settlement batch
(``--batch`` requests of 3 token descriptors, each request its own lease) as
:mod:`extproc.adapters.rls_client` sends it. The config
is the gateway bench's (bench/front.py: requests and tokens limits on api key, tenant and model).
No I/O: the log goes to ``/dev/null``, the batcher's calls encode and return. CPU time per
request (``time.process_time``), minimum and median of the rounds: on a shared machine the
minimum is the better guide to what the code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from bench import bodies, front
from bench.h2_extproc_load import body, headers
from extproc.actions import Descriptor
from extproc.adapters import rls_pb
from extproc.adapters.service import ExternalProcessor
from extproc.canary.guard import CanaryGuards, GuardedTelemetry
from extproc.settlements import SettlementBatcher, settlement_for
from extproc.telemetry.metrics import ExtprocMetrics, settlements_counter
from extproc.telemetry.request_log import LoggedTelemetry
from routing.compiled import Snapshot, compile_config
from sidecar_runtime.h2grpc import Context
from sidecar_runtime.process import logs
from sidecar_runtime.process.settings import Settings

_Request = pb.ProcessingRequest


def snapshot() -> Snapshot:
    return compile_config(front.bench_config())


def messages(request_id: str) -> list[bytes]:
    """The four messages as Envoy's ext_proc filter sends them for one chat request."""
    request = bodies.chat_request()
    response = bodies.chat_response().encode()
    stream = [
        headers("request_headers", [
            (":authority", "127.0.0.1:10000"), (":path", "/v1/chat/completions"),
            (":method", "POST"), (":scheme", "http"), ("content-type", "application/json"),
            ("authorization", "Bearer sk-bench-0123456789"), ("user-agent", "bench/1"),
            ("content-length", str(len(request))), ("x-forwarded-proto", "http"),
            ("x-request-id", request_id)]),
        body("request_body", request),
        headers("response_headers", [
            (":status", "200"), ("content-type", "application/json"),
            ("content-length", str(len(response))), ("date", "Mon, 01 Jan 2024 00:00:00 GMT"),
            ("x-envoy-upstream-service-time", "1")]),
        body("response_body", response),
    ]
    stream[0].request_headers.end_of_stream = False
    stream[2].response_headers.end_of_stream = False
    return [message.SerializeToString() for message in stream]


class _Context:
    """What ``Process`` may ask of its call context (nothing, on this path)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"Process asked its context for {name}")


class _Incoming:
    """The messages of one stream, parsed as the server's call parses them (an iterator
    object as the server's call is: an async generator here would cost its finaliser)."""

    def __init__(self, raw: list[bytes]) -> None:
        self._raw = iter(raw)

    def __aiter__(self) -> _Incoming:
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        data = next(self._raw, None)
        if data is None:
            raise StopAsyncIteration
        return cast(pb.ProcessingRequest, _Request.FromString(data))


async def _one(servicer: ExternalProcessor, raw: list[bytes]) -> int:
    """One stream: parse each message, answer it, serialise the answer (the server's work
    around the servicer); then Envoy's reset (``aclose``: the servicer's ``finally``)."""
    answers = cast(AsyncGenerator[pb.ProcessingResponse, None],
                   servicer.Process(_Incoming(raw), cast(Context, _Context())))
    size = 0
    for _ in raw:
        size += len((await answers.__anext__()).SerializeToString())
    await answers.aclose()
    return size


class _Encoder:
    """The batcher's send: encode the batch as :mod:`extproc.adapters.rls_client` does, answer OK."""

    def __init__(self) -> None:
        self.batches = 0

    async def __call__(self, descriptors: tuple[Descriptor, ...]) -> bool:
        rls_pb.settle_payload(descriptors)
        self.batches += 1
        return True


def _servicer(current: Snapshot, encoder: _Encoder) -> tuple[ExternalProcessor, SettlementBatcher]:
    registry = CollectorRegistry()
    metrics = ExtprocMetrics(registry, lambda: current.known_tenants)
    guards = CanaryGuards()
    telemetry = GuardedTelemetry(LoggedTelemetry(metrics), guards, lambda: current,
                                 metrics.canary_tripped)
    # min_batch 1: at saturation every settlement joins a batch (docs/decisions/0005-settlement-batches.md).
    batcher = SettlementBatcher(encoder, 0.005, settlements_counter(registry), 1)
    settings = Settings(dev_mode=True)
    servicer = ExternalProcessor(lambda: current, settings, telemetry, guards,
                                 settlements=batcher)
    return servicer, batcher


async def _requests(requests: int, rounds: int) -> tuple[list[float], int]:
    current = snapshot()
    encoder = _Encoder()
    servicer, batcher = _servicer(current, encoder)
    # Distinct request ids, as Envoy's (the log line and sampling read them).
    streams = [messages(str(uuid.UUID(int=i))) for i in range(64)]
    await _one(servicer, streams[0])  # warm: first-use caches, loggers
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for i in range(requests):
            await _one(servicer, streams[i % len(streams)])
        await batcher.aclose()  # the batches of this round are encoded inside it
        times.append((time.process_time() - started) / requests * 1e6)
        servicer, batcher = _servicer(current, encoder)
    return times, encoder.batches


def batches(requests: int, count: int) -> list[tuple[Descriptor, ...]]:
    """``count`` batches of the token descriptors ``requests`` settled requests send (3 each:
    api key, tenant, model), as :func:`extproc.settlements.settlement_for` builds them: 16 api
    keys, each request its own lease, as at saturation."""
    config = snapshot().config
    out: list[tuple[Descriptor, ...]] = []
    for b in range(count):
        descriptors: list[Descriptor] = []
        for i in range(requests):
            settlement = settlement_for(config, (
                ("x-llm-key-id", f"k_{i % 16:024x}"), ("x-llm-tenant", "default"),
                ("x-llm-model", bodies.MODEL)), f"{b:012x}{i:012x}", 60 + i % 40)
            assert settlement is not None
            descriptors.extend(settlement.descriptors)
        out.append(tuple(descriptors))
    return out


def _time(fn: Callable[[], object], calls: int, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - started) / calls * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.extproc_python",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=85, help="requests per settlement batch")
    args = parser.parse_args()
    saved = sys.stderr
    with open(os.devnull, "w", encoding="utf-8") as null:
        sys.stderr = null  # the log line is rendered and written, to nowhere
        try:
            logs.configure("info", "extproc")
            per_request, encoded = asyncio.run(_requests(args.requests, args.rounds))
        finally:
            sys.stderr = saved
    # More leases than extproc.adapters.rls_pb keeps encoded, so its cache is as cold as in use.
    several = batches(args.batch, 100)
    turn = iter(range(1 << 62))
    encode = _time(lambda: rls_pb.settle_payload(several[next(turn) % len(several)]),
                   max(1, args.requests // 30), args.rounds)
    print(f"one chat request: 4 messages; {encoded} settlement batches encoded on the way; "
          f"a batch of {args.batch} requests: {len(several[0])} descriptors")
    print("| stage | µs CPU min | median |\n|---|---|---|")
    for name, times in (("chat request, 4 messages", per_request),
                        (f"settlement batch of {args.batch}", encode)):
        print(f"| {name} | {min(times):.1f} | {statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
