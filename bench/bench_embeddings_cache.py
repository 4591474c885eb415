"""Embedding cache: the hit path against the uncached path, through real Envoy, in one run.

    .venv/bin/python -m bench.bench_embeddings_cache [--requests 3000] [--concurrency 16]
        [--batch 8] [--dim 1024]

One gateway (Envoy, extproc, a simulated embeddings pool) on a real Redis, and one on extproc's
memory backend. Scenarios, each ``--requests`` POST /v1/embeddings of ``--batch`` inputs from
``--concurrency`` keep-alive connections:

* ``uncached``: a model without ``cache:`` (routing only; the response streams back through
  extproc to have its usage read);
* ``miss + store``: a cached model, every input new (lookup, pass-through copy, background store);
* ``hit, Redis`` / ``hit, memory``: a cached model, every input cached (extproc answers).

The "vLLM" is the simulator: it answers an embeddings batch in well under a millisecond, where
a GPU takes milliseconds to tens of milliseconds, so the hit path's gain here is a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.acct import cpu_seconds
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.redis_servers import start_redis

CACHE = {"namespace": "bench", "ttl": "1h"}


def gateway_doc(dim: int) -> dict[str, Any]:
    doc = default_doc()
    doc["clusters"]["embed"]["simulate"] = {"embedding_dim": dim}
    doc["models"]["bge-m3"]["cache"] = CACHE
    doc["models"]["bge-m3-plain"] = {"kind": "embedding", "clusters": ["embed"]}
    return doc


def body(model: str, batch: int, seed: str) -> bytes:
    return json.dumps({"model": model, "input": [f"{seed} passage {j}" for j in range(batch)],
                       "encoding_format": "base64"}).encode()


async def load(url: str, bodies: Callable[[int], bytes], requests: int,
               concurrency: int) -> dict[str, float | str]:
    latencies: list[float] = []
    caches: dict[str, int] = {}
    counter = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for i in counter:
                payload = bodies(i)
                started = time.perf_counter()
                async with session.post(url, data=payload,
                                        headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                    cache = resp.headers.get("x-llm-cache", "-")
                latencies.append(time.perf_counter() - started)
                caches[cache] = caches.get(cache, 0) + 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "requests_per_s": requests / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1000,
        "x_llm_cache": ",".join(f"{k}={v}" for k, v in sorted(caches.items())),
    }


def stored_vectors(gw: Gateway) -> float:
    with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llm_sidecar_cache_stored_vectors_total "):
                return float(line.split()[-1])
    return 0.0


def warm(gw: Gateway, args: argparse.Namespace, seeds: int) -> None:
    """Every batch the hit scenario sends, cached (stores are asynchronous: wait for them)."""
    asyncio.run(load(f"{gw.url}/v1/embeddings", lambda i: body("bge-m3", args.batch, f"w{i}"),
                     seeds, args.concurrency))
    deadline = time.monotonic() + 30
    while stored_vectors(gw) < seeds * args.batch:
        assert time.monotonic() < deadline, "the warm-up vectors were never stored"
        time.sleep(0.05)


def measure(name: str, gw: Gateway, bodies: Callable[[int], bytes],
            args: argparse.Namespace) -> dict[str, Any]:
    url = f"{gw.url}/v1/embeddings"
    asyncio.run(load(url, bodies, min(200, args.requests), args.concurrency))  # warm-up
    extproc = gw.child("extproc")
    before = cpu_seconds(extproc.process.pid)
    result: dict[str, Any] = asyncio.run(load(url, bodies, args.requests, args.concurrency))
    result["extproc_cpu_us_per_request"] = (cpu_seconds(extproc.process.pid) - before) / args.requests * 1e6
    result["scenario"] = name
    print(json.dumps(result), flush=True)
    return result


def run(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seeds = 500
    redis = start_redis(allow_external=False)
    try:
        env = {"LLM_SIDECAR_REDIS_URL": redis.url, "LLM_SIDECAR_LOG_LEVEL": "error"}
        with running_gateway(gateway_doc(args.dim), os.path.join(workdir, "redis"), env=env,
                             capture_logs=True) as gw:
            rows.append(measure("uncached", gw,
                                lambda i: body("bge-m3-plain", args.batch, f"w{i % seeds}"), args))
            fresh = iter(range(10**9))
            rows.append(measure("miss + store, Redis", gw,
                                lambda i: body("bge-m3", args.batch, f"m{next(fresh)}"), args))
            warm(gw, args, seeds)
            rows.append(measure("hit, Redis", gw,
                                lambda i: body("bge-m3", args.batch, f"w{i % seeds}"), args))
    finally:
        redis.stop()
    env = {"LLM_SIDECAR_LOG_LEVEL": "error"}
    with running_gateway(gateway_doc(args.dim), os.path.join(workdir, "memory"), env=env,
                         capture_logs=True) as gw:
        warm(gw, args, seeds)
        rows.append(measure("hit, memory", gw,
                            lambda i: body("bge-m3", args.batch, f"w{i % seeds}"), args))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="inputs per request")
    parser.add_argument("--dim", type=int, default=1024, help="embedding size")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as workdir:
        rows = run(args, workdir)
    base = rows[0]
    print(f"\n{args.batch} inputs x {args.dim} dims per request (base64), "
          f"concurrency {args.concurrency}, {args.requests} requests per scenario\n")
    print("| scenario | requests/s | p50 ms | p99 ms | p50 vs uncached | extproc CPU µs/request |"
          " x-llm-cache |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['scenario']} | {row['requests_per_s']:.0f} | {row['p50_ms']:.2f} | "
              f"{row['p99_ms']:.2f} | {row['p50_ms'] / base['p50_ms']:.2f}x | "
              f"{row['extproc_cpu_us_per_request']:.0f} | {row['x_llm_cache']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
