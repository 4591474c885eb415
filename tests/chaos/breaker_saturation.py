"""Measure what one CPU-starved moment does to the rate limiter's Redis breaker.

A ratelimit process on real Redis (50 ms deadline) answers a steady stream of ShouldRateLimit
calls while busy-loop processes keep every core saturated. A deadline missed because the
ratelimit process did not get the CPU in time looks like a frozen Redis. With
``LLM_SIDECAR_REDIS_BREAKER_FAILURES=1`` one such miss opens the breaker, and for the next
second every request gets ``on_backend_error`` (with ``allow``: admitted unchecked); with 3 (the
default) the breaker needs three misses in a row.

    .venv/bin/python -m tests.chaos.breaker_saturation [--seconds 20] [--hogs 3]

Prints, per setting: calls, missed deadlines, breaker openings, and calls answered by policy
instead of Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from sidecar_runtime.process.procs import free_port, wait_http_ok, wait_tcp
from tests.chaos.support import metric
from tests.harness.redis_servers import ProcessRedis, redis_binary

CONFIG = """domain: llm
on_backend_error: allow
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 1000000}
"""


def request(n: int) -> rls_pb2.RateLimitRequest:
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="api_key", value=f"k{n % 100}")
    return rls_pb2.RateLimitRequest(domain="llm", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[entry])])


async def drive(port: int, seconds: float, concurrency: int) -> int:
    calls = 0
    deadline = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)

        async def user(u: int) -> None:
            nonlocal calls
            n = u
            while time.monotonic() < deadline:
                await stub.ShouldRateLimit(request(n), timeout=5)
                calls += 1
                n += concurrency

        await asyncio.gather(*(user(u) for u in range(concurrency)))
    return calls


def measure(redis_url: str, failures: int, seconds: float, hogs: int, concurrency: int,
            workdir: Path) -> dict[str, float]:
    config = workdir / "ratelimit.yaml"
    config.write_text(CONFIG)
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "LLM_SIDECAR_REDIS_URL": redis_url, "LLM_SIDECAR_DEV_MODE": "true",
           "LLM_SIDECAR_REDIS_BREAKER_FAILURES": str(failures),
           "LLM_SIDECAR_LOG_LEVEL": "error"}
    service = subprocess.Popen([sys.executable, "-m", "llm_sidecar", "ratelimit", "--config",
                                str(config), "--port", str(port), "--metrics-port",
                                str(metrics_port)], env=env)
    burners = []
    try:
        wait_tcp("127.0.0.1", port, 30)
        url = f"http://127.0.0.1:{metrics_port}"
        wait_http_ok(f"{url}/healthz", 30)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(hogs)]
        calls = asyncio.run(drive(port, seconds, concurrency))
        return {
            "calls": calls,
            "missed_deadlines": metric(url, "ratelimit_backend_errors_total", reason="timeout"),
            "skipped_by_open_breaker": metric(url, "ratelimit_backend_errors_total",
                                              reason="breaker_open"),
            "answered_by_policy": metric(url, "ratelimit_decisions_total",
                                         result="backend_allow"),
        }
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        service.terminate()
        service.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.breaker_saturation")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--hogs", type=int, default=6, help="busy-loop processes (default 6)")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    args = parser.parse_args(argv)
    binary = redis_binary()
    if binary is None:
        print("no redis-server", file=sys.stderr)
        return 1
    redis = ProcessRedis(binary=binary).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for failures in (1, 3):
                found = measure(redis.url, failures, args.seconds, args.hogs,
                                args.concurrency, Path(tmp))
                share = found["answered_by_policy"] / max(1.0, found["calls"]) * 100
                print(f"breaker_failures={failures}: {found['calls']:.0f} calls, "
                      f"{found['missed_deadlines']:.0f} missed deadlines, "
                      f"{found['skipped_by_open_breaker']:.0f} skipped while open, "
                      f"{found['answered_by_policy']:.0f} answered by on_backend_error "
                      f"({share:.2f} %)")
    finally:
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
