"""Rate-limit service decisions/s and latency, memory and Redis stores, against a no-op RLS.

    .venv/bin/python -m bench.ratelimit_rls [--requests 20000] [--concurrency 32]

Each request carries 3 descriptors (api_key, tenant, model), like the gateway sends. Every
server runs in its own process; the load comes from this process over real gRPC. All numbers
in one table come from the same run, so compare rows, not machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from bench.acct import cpu_seconds
from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_tcp
from tests.harness.redis_servers import start_redis

DESCRIPTORS = """\
domain: bench
descriptors:
  - key: kind
    value: requests
    descriptors:
      - {key: api_key, rate_limit: {unit: second, requests_per_unit: 1000000}}
      - {key: tenant, rate_limit: {unit: second, requests_per_unit: 1000000}}
      - {key: model, rate_limit: {unit: second, requests_per_unit: 1000000}}
"""

NOOP_SERVER = """
import asyncio, sys, grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
OK = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
class Noop(rls_pb2_grpc.RateLimitServiceServicer):
    async def ShouldRateLimit(self, request, context):
        return OK
async def main():
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Noop(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


def request(i: int) -> rls_pb2.RateLimitRequest:
    msg = rls_pb2.RateLimitRequest(domain="bench")
    for key, value in (("api_key", f"k{i % 500}"), ("tenant", f"t{i % 20}"), ("model", "m")):
        descriptor = msg.descriptors.add()
        for k, v in (("kind", "requests"), (key, value)):
            entry = descriptor.entries.add()
            entry.key, entry.value = k, v
    return msg


async def load(port: int, requests: int, concurrency: int) -> dict[str, float]:
    messages = [request(i) for i in range(1000)]
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for i in range(200):  # warm-up: connections, script load, caches
            await stub.ShouldRateLimit(messages[i % 1000])
        counter = iter(range(requests))

        async def worker() -> None:
            for i in counter:
                started = time.perf_counter()
                await stub.ShouldRateLimit(messages[i % 1000])
                latencies.append(time.perf_counter() - started)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "decisions_per_s": requests / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1000,
    }


def measure(name: str, child: Child, port: int, args: argparse.Namespace) -> dict[str, Any]:
    wait_tcp("127.0.0.1", port, 30, child)
    before = cpu_seconds(child.process.pid)
    result: dict[str, Any] = asyncio.run(load(port, args.requests, args.concurrency))
    result["server_cpu_us_per_decision"] = \
        (cpu_seconds(child.process.pid) - before) / args.requests * 1e6
    result["scenario"] = name
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        config = os.path.join(workdir, "bench.yaml")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write(DESCRIPTORS)
        redis = start_redis(allow_external=False)
        try:
            scenarios = [
                ("no-op RLS", [sys.executable, "-c", NOOP_SERVER], {}),
                ("ratelimit, memory", None, {}),
                ("ratelimit, Redis", None, {"LLM_SIDECAR_REDIS_URL": redis.url}),
            ]
            for name, command, env in scenarios:
                port = free_port()
                cmd = [*command, str(port)] if command else sidecar_command(
                    "ratelimit", "--config", config, "--port", str(port),
                    "--metrics-port", str(free_port()))
                child = start(name, cmd, env={**os.environ, "LLM_SIDECAR_LOG_LEVEL": "error",
                                              **env},
                              log_path=os.path.join(workdir, "server.log"))
                try:
                    rows.append(measure(name, child, port, args))
                finally:
                    child.stop()
        finally:
            redis.stop()
    base = rows[0]
    print("| scenario | decisions/s | p50 ms | p99 ms | added p50 ms | added p99 ms | "
          "server CPU µs/decision |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['scenario']} | {row['decisions_per_s']:.0f} | {row['p50_ms']:.2f} | "
              f"{row['p99_ms']:.2f} | {row['p50_ms'] - base['p50_ms']:.2f} | "
              f"{row['p99_ms'] - base['p99_ms']:.2f} | {row['server_cpu_us_per_decision']:.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
