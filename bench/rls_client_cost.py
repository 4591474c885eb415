"""CPU per call of extproc's rate-limit client: grpc.aio's against ours (h2grpc.client).

    .venv/bin/python -m bench.rls_client_cost [--seconds 4] [--repeats 2] [--descriptors 12]

The ratelimit service (memory store) runs in its own process; each client runs in a process of
its own on uvloop (as extproc does; grpcio's threads, once started, would stay in a shared one),
alternating. Two patterns: ``paced``, one settlement-sized call every 20 ms (extproc's batches
at 200 req/s: ~4 settlements of 3 descriptors), where CPU per call includes what the client
costs between calls; and ``loop``, calls back to back. CPU is the client process's own
(every thread), per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from bench.acct import cpu_seconds
from sidecar_runtime.process.procs import free_port, sidecar_command, start, wait_tcp

CONFIG = """\
domain: llm-sidecar
descriptors:
  - key: kind
    value: tokens
    descriptors: [{key: tenant, rate_limit: {unit: day, requests_per_unit: 1000000000}}]
"""
METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


def request(descriptors: int) -> rls_pb2.RateLimitRequest:
    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    return rls_pb2.RateLimitRequest(domain="llm-sidecar", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[entry(key="kind", value="tokens"),
                                                   entry(key="tenant", value=f"t{i}")])
        for i in range(descriptors)])


async def client_run(kind: str, port: int, pattern: str, seconds: float,
                     descriptors: int) -> dict[str, float]:
    message = request(descriptors)
    parse = rls_pb2.RateLimitResponse.FromString
    if kind == "grpcio":
        import grpc
        from envoy.service.ratelimit.v3 import rls_pb2_grpc
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)

        async def call() -> None:
            await stub.ShouldRateLimit(message, timeout=1)

        close = channel.close
    else:
        from sidecar_runtime.h2grpc.client import Channel
        ours = Channel(f"127.0.0.1:{port}")

        async def call() -> None:
            await ours.unary_unary(METHOD, message, parse, 1)

        close = ours.aclose
    for _ in range(200):  # warm-up: the connection, caches
        await call()
    calls = 0
    started, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - started < seconds:
        await call()
        calls += 1
        if pattern == "paced":
            await asyncio.sleep(0.02)
    used = time.process_time() - cpu
    threads = len(os.listdir("/proc/self/task"))
    await close()
    return {"calls": calls, "us_per_call": used / calls * 1e6, "threads": threads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--descriptors", type=int, default=12)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "PORT", "PATTERN"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop
        kind, port, pattern = args.child
        print(json.dumps(uvloop.run(client_run(kind, int(port), pattern, args.seconds,
                                               args.descriptors))))
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        config = os.path.join(workdir, "rls.yaml")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write(CONFIG)
        port = free_port()
        server = start("ratelimit", sidecar_command(
            "ratelimit", "--config", config, "--port", str(port), "--metrics-port",
            str(free_port())), env={**os.environ, "LLM_SIDECAR_LOG_LEVEL": "error"},
            log_path=os.path.join(workdir, "server.log"))
        try:
            wait_tcp("127.0.0.1", port, 30, server)
            print("| pattern | client | calls | client µs CPU/call | server µs CPU/call | "
                  "client threads |\n|---|---|---|---|---|---|")
            for _ in range(args.repeats):
                for pattern in ("paced", "loop"):
                    for kind in ("grpcio", "h2grpc"):
                        before = cpu_seconds(server.process.pid)
                        out = subprocess.run(
                            [sys.executable, "-m", "bench.rls_client_cost", "--seconds",
                             str(args.seconds), "--descriptors", str(args.descriptors),
                             "--child", kind, str(port), pattern],
                            check=True, capture_output=True, text=True).stdout
                        row = json.loads(out)
                        served = (cpu_seconds(server.process.pid) - before) / (row["calls"] + 200)
                        print(f"| {pattern} | {kind} | {row['calls']} | "
                              f"{row['us_per_call']:.0f} | {served * 1e6:.0f} | "
                              f"{row['threads']} |", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
