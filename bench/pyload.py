"""Async Python load generator, used when wrk is not installed (and by the smoke test).

``python -m bench.pyload --url URL --body FILE [--header 'k: v']... --duration S
--connections C [--rate R]``

With ``--rate``, request *i* is due at ``i / R`` s (open loop: a slow answer does not delay the
next arrival) and is timed from when it is sent on one of ``C`` keep-alive connections; without
it, ``C`` workers send back to back (saturation). Prints the same JSON summary line as the wrk
script of :mod:`bench.loadgen`. It costs far more CPU per request than wrk, on the same cores
as the gateway: the report names the load generator used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import aiohttp


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
               out: list[tuple[int, float]]) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError):
        status = 599
    out.append((status, (time.perf_counter() - t0) * 1000))


async def _fixed(session: aiohttp.ClientSession, args: argparse.Namespace, body: bytes,
                 headers: dict[str, str], out: list[tuple[int, float]]) -> float:
    """Send on schedule, then wait for every answer; the sending window in seconds (longer
    than ``--duration`` when this process fell behind its schedule)."""
    total = max(1, round(args.rate * args.duration))
    start = time.perf_counter()
    tasks: set[asyncio.Task[None]] = set()
    for i in range(total):
        delay = start + i / args.rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(_one(session, args.url, body, headers, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    sent_s = max(float(args.duration), time.perf_counter() - start)
    if tasks:
        await asyncio.gather(*tasks)
    return sent_s


async def _saturate(session: aiohttp.ClientSession, args: argparse.Namespace, body: bytes,
                    headers: dict[str, str], out: list[tuple[int, float]]) -> None:
    deadline = time.perf_counter() + args.duration

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await _one(session, args.url, body, headers, out)

    await asyncio.gather(*(worker() for _ in range(args.connections)))


def summary(out: list[tuple[int, float]], elapsed: float,
            sent_s: float | None = None) -> dict[str, float | int | None]:
    latencies = sorted(ms for _, ms in out)

    def pct(p: float) -> float | None:
        if not latencies:
            return None
        return round(latencies[max(0, math.ceil(p / 100 * len(latencies)) - 1)], 3)

    doc: dict[str, float | int | None] = {
        "requests": len(out), "errors": sum(1 for status, _ in out if status >= 400),
        "elapsed_s": round(elapsed, 6), "p50": pct(50), "p90": pct(90), "p99": pct(99),
        "p999": pct(99.9), "max": pct(100)}
    if sent_s is not None:
        doc["sent_s"] = round(sent_s, 6)
    return doc


async def main_async(args: argparse.Namespace, body: bytes) -> dict[str, float | int | None]:
    headers = {}
    for item in args.header:
        name, _, value = item.partition(":")
        headers[name.strip()] = value.strip()
    out: list[tuple[int, float]] = []
    connector = aiohttp.TCPConnector(limit=args.connections)
    started = time.perf_counter()
    sent_s = None
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        if args.rate:
            sent_s = await _fixed(session, args, body, headers, out)
        else:
            await _saturate(session, args, body, headers, out)
    return summary(out, time.perf_counter() - started, sent_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True)
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.0)
    args = parser.parse_args()
    result = asyncio.run(main_async(args, Path(args.body).read_bytes()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
