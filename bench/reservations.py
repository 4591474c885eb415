"""What token reservations cost: ratelimit CPU, latency and Redis work per request, before/after.

    .venv/bin/python -m bench.reservations [--requests 5000] [--concurrency 16]

Each request touches 3 levels (api_key, tenant, model) and makes the calls Envoy makes for it,
over real gRPC to one ratelimit process on a real Redis (then the memory store), one scenario
after another in the same run:

* ``requests only``: one admission call, 3 requests buckets.
* ``check, then charge (before)``: the old token scheme: admission checks 3 token buckets
  (``debt``, hits 0) beside the requests ones; the stream-done call charges the usage as debt.
  Concurrent requests could all pass the check: this is what reservations replaced.
* ``reserve, then settle (after)``: admission reserves on 3 token buckets under a lease; the
  stream-done call settles the usage against it.
* ``… + concurrency caps``: the same plus 3 concurrency caps (a slot held, then released).

Redis work comes from ``INFO commandstats`` (reset before each scenario): EVALSHA calls and
microseconds per request, i.e. how many requests/s one Redis core can serve.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc
import redis
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from bench.acct import cpu_seconds
from sidecar_runtime.process.procs import free_port, sidecar_command, start, wait_tcp
from sidecar_runtime.wire.names import LEASE_ENTRY, RELEASE_ENTRY, USED_ENTRY
from tests.harness.redis_servers import start_redis

LEVELS = ("api_key", "tenant", "model")
BIG = 1_000_000_000


def _limits(kind: str, extra: str) -> str:
    rows = "\n".join(f"      - {{key: {level}, rate_limit: {{{extra}}}}}" for level in LEVELS)
    return f"  - key: kind\n    value: {kind}\n    descriptors:\n{rows}\n"


DESCRIPTORS = ("domain: bench\ndescriptors:\n"
               + _limits("requests", f"unit: second, requests_per_unit: {BIG}")
               + _limits("tokens", f"unit: second, requests_per_unit: {BIG}")
               + _limits("debt_tokens", f"unit: second, requests_per_unit: {BIG}, debt: true")
               + _limits("concurrent", "concurrent: 100000"))

Message = rls_pb2.RateLimitRequest
Calls = Callable[[int], list[rls_pb2.RateLimitRequest]]
"""Request number → the RLS calls Envoy makes for it, in order."""


def _descriptor(msg: rls_pb2.RateLimitRequest, kind: str, level: str, value: str, *extra: tuple[str, str],
                hits: int | None = None) -> None:
    descriptor = msg.descriptors.add()
    for key, val in (("kind", kind), (level, value), *extra):
        entry = descriptor.entries.add()
        entry.key, entry.value = key, val
    if hits is not None:
        descriptor.hits_addend.value = hits


def _values(i: int) -> dict[str, str]:
    return {"api_key": f"k{i % 500}", "tenant": f"t{i % 20}", "model": "m"}


def requests_only(i: int) -> list[rls_pb2.RateLimitRequest]:
    admit = Message(domain="bench")
    for level, value in _values(i).items():
        _descriptor(admit, "requests", level, value)
    return [admit]


def check_then_charge(i: int) -> list[rls_pb2.RateLimitRequest]:
    admit, done = requests_only(i)[0], Message(domain="bench")
    for level, value in _values(i).items():
        _descriptor(admit, "debt_tokens", level, value, hits=0)
        _descriptor(done, "debt_tokens", level, value, hits=300)
    return [admit, done]


def reserve_then_settle(i: int, concurrency: bool = False) -> list[rls_pb2.RateLimitRequest]:
    lease = f"lease{i:019d}"
    admit, done = requests_only(i)[0], Message(domain="bench")
    for level, value in _values(i).items():
        _descriptor(admit, "tokens", level, value, (LEASE_ENTRY, lease), hits=500)
        _descriptor(done, "tokens", level, value, (LEASE_ENTRY, lease), (USED_ENTRY, "300"))
        if concurrency:
            _descriptor(admit, "concurrent", level, value, (LEASE_ENTRY, lease))
            _descriptor(done, "concurrent", level, value, (LEASE_ENTRY, lease),
                        (RELEASE_ENTRY, "1"))
    return [admit, done]


SCENARIOS: list[tuple[str, Calls]] = [
    ("requests only", requests_only),
    ("check, then charge (before)", check_then_charge),
    ("reserve, then settle (after)", reserve_then_settle),
    ("reserve, settle + concurrency caps", lambda i: reserve_then_settle(i, True)),
]


async def warm(port: int, calls: Calls) -> None:
    """Connections and the Lua scripts loaded, before anything is counted."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for i in range(-200, 0):
            for message in calls(i):
                await stub.ShouldRateLimit(message)


async def load(port: int, calls: Calls, requests: int, concurrency: int) -> dict[str, float]:
    """Run ``requests`` requests; latency is the admission call's (what the client waits for)."""
    admissions: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        counter = iter(range(requests))

        async def worker() -> None:
            for i in counter:
                messages = calls(i)
                started = time.perf_counter()
                response = await stub.ShouldRateLimit(messages[0])
                admissions.append(time.perf_counter() - started)
                assert response.overall_code == rls_pb2.RateLimitResponse.OK
                for message in messages[1:]:
                    await stub.ShouldRateLimit(message)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    admissions.sort()
    return {"requests_per_s": requests / elapsed,
            "p50_ms": statistics.median(admissions) * 1000,
            "p99_ms": admissions[int(0.99 * (len(admissions) - 1))] * 1000}


def evalsha(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats")
    row = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(row["calls"]), int(row["usec"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        config = os.path.join(workdir, "bench.yaml")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write(DESCRIPTORS)
        server = start_redis(allow_external=False)
        stats = redis.Redis.from_url(server.url)
        try:
            for store, env in (("Redis", {"LLM_SIDECAR_REDIS_URL": server.url,
                                          "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}),
                               ("memory", {})):
                port = free_port()
                child = start(f"ratelimit-{store}", sidecar_command(
                    "ratelimit", "--config", config, "--port", str(port),
                    "--metrics-port", str(free_port())),
                    env={**os.environ, "LLM_SIDECAR_LOG_LEVEL": "error", **env},
                    log_path=os.path.join(workdir, f"{store}.log"))
                try:
                    wait_tcp("127.0.0.1", port, 30, child)
                    for name, calls in SCENARIOS:
                        asyncio.run(warm(port, calls))
                        stats.config_resetstat()
                        cpu = cpu_seconds(child.process.pid)
                        row: dict[str, Any] = dict(asyncio.run(
                            load(port, calls, args.requests, args.concurrency)))
                        row["cpu_us"] = (cpu_seconds(child.process.pid) - cpu) / args.requests * 1e6
                        n, usec = evalsha(stats)
                        row.update(store=store, scenario=name, calls=len(calls(0)),
                                   evalsha=n / args.requests, redis_us=usec / args.requests)
                        rows.append(row)
                finally:
                    child.stop()
        finally:
            stats.close()
            server.stop()
    print(f"{args.requests} requests, {args.concurrency} at a time; 3 levels per request\n")
    print("| store | scenario | RLS calls | Redis EVALSHA / req | Redis µs / req | ratelimit CPU "
          "µs / req | admission p50 ms | admission p99 ms | req/s |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        redis_cols = (f"{row['evalsha']:.2f} | {row['redis_us']:.0f}" if row["store"] == "Redis"
                      else "n/a | n/a")
        print(f"| {row['store']} | {row['scenario']} | {row['calls']} | {redis_cols} | "
              f"{row['cpu_us']:.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
              f"{row['requests_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
