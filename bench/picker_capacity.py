"""``python -m bench.picker_capacity``: the endpoint picker against Envoy's least request at
about 60%, 85% and 100% of the pool's capacity, open loop (issue 36).

    .venv/bin/python -m bench.picker_capacity [--decode-ms 15/15/22.5/45] [--max-num-seqs 6]
        [--loads 0.6,0.85,1.0] [--repeats 3] [--duration 40] [--capacity REQ_PER_S]
        [--picker '{}'] [--prefill-ms 0.1]

Pods: one simulator per ``--decode-ms`` entry (milliseconds per output token; ``15/15/22.5/45``
is two pods at full speed, one 1.5x and one 3x slower; ``15/15/15/15`` a pool of equal pods),
each running at most ``--max-num-seqs`` sequences (the rest wait, as in vLLM), prefill
``--prefill-ms`` per uncached prompt token at the fast pods' speed (the others' slower in the
same proportion), a prefix cache of vLLM's block size.

Workload: Poisson arrivals of streamed chats from one fixed script (:mod:`bench.picker_workload`,
same seed in both modes): 70% start with one of 16 shared system prompts of ~1,000 tokens, 30%
carry a document of their own (1,000 to 2,000 tokens); 32 to 96 output tokens each.

Capacity: what least request completes per second with twice as many closed-loop clients as
the pool has sequence slots (``--capacity`` skips that measurement). Each load is a rate of
``load x capacity``; per repeat both modes run (the order alternating between repeats), on fresh
pods and a fresh gateway each. The table gives the median over repeats of each figure and of
each picker / least-request ratio, and each pod's share of the requests against its share of
the pool's capacity (its speed's share, as every pod has the same slots). The done-criteria of
issue 36 are checked at the end: on pods of uneven speed, picker TTFT P99 <= 0.7x, TTFT P50
<= 1.0x, end-to-end P99 <= 0.9x, throughput >= 0.97x and no pod below half of its capacity share;
on equal pods, no figure worse than 1.05x. Everything shares the machine's cores: compare the two
modes of one run, never figures of two runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp

from bench.picker_load import Load, Pool, drive, run_mode, send
from bench.picker_workload import Corpus, ModeReport, Request, Workload, percentile, script

WORKLOAD = Workload(groups=16, system_tokens=1000, turns=(1, 1), long_share=0.3,
                    long_tokens=(1000, 2000), long_max_tokens=64, chat_max_tokens=(32, 96))
"""Issue 36's mix: 70% share one of 16 long system prompts, 30% a long prompt of their own."""


async def open_loop(url: str, *, requests: Sequence[Request], rate: float, duration_s: float,
                    seed: int) -> Load:
    """Send ``requests`` in order at Poisson arrivals of ``rate`` per second for ``duration_s``;
    wait for every one to finish."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
    tasks: list[asyncio.Task[Any]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0 = loop.time()
        at = rng.expovariate(rate)
        for req in requests:
            if at >= duration_s:
                break
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, req, t0)))
            at += rng.expovariate(rate)
        results = list(await asyncio.gather(*tasks))
    attempts = len(results) + sum(r.shed for r in results)
    return Load(results, attempts, duration_s)


@dataclass(frozen=True)
class Figures:
    """The figures of one mode the issue judges."""

    ttft_p50: float
    ttft_p99: float
    e2e_p99: float
    throughput: float
    failed: int
    shares: tuple[float, ...]

    @classmethod
    def of(cls, report: ModeReport) -> Figures:
        ok = [r for r in report.results if r.status == 200]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        e2e = [r.ended - r.started for r in ok]
        served = sum(p.requests for p in report.pods) or math.nan
        return cls(percentile(ttft, 50), percentile(ttft, 99), percentile(e2e, 99),
                   len([r for r in ok if r.ended <= report.window_s]) / report.window_s,
                   len(report.results) - len(ok),
                   tuple(p.requests / served for p in report.pods))


def capacity(pool: Pool, workload: Workload, duration_s: float) -> float:
    """Requests/s least request completes with twice as many closed-loop clients as slots."""
    slots = (pool.max_num_seqs or 256) * len(pool.speeds)
    report, _ = run_mode("least request", None, pool,
                         partial(drive, workload=workload, clients=2 * slots,
                                 duration_s=duration_s, per_client=None))
    return Figures.of(report).throughput


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 1000:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.picker_capacity",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--decode-ms", default="15/15/22.5/45",
                        help="ms per output token, one pod each (default 15/15/22.5/45)")
    parser.add_argument("--max-num-seqs", type=int, default=6)
    parser.add_argument("--prefill-ms", type=float, default=0.1,
                        help="ms per uncached prompt token on the fastest pod (default 0.1)")
    parser.add_argument("--loads", default="0.6,0.85,1.0", help="shares of the capacity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals a mode")
    parser.add_argument("--capacity", type=float, help="req/s; default: measured first")
    parser.add_argument("--picker", default="{}", type=json.loads,
                        help="the pool's endpoint_picker settings in the picker mode, as JSON")
    parser.add_argument("--seed", type=int, default=WORKLOAD.seed)
    args = parser.parse_args(argv)
    decode = [float(d) for d in args.decode_ms.split("/")]
    fastest = min(decode)
    pool = Pool(speeds=tuple(fastest / d for d in decode), prefill_ms_per_token=args.prefill_ms,
                decode_ms_per_token=fastest, kv_cache_tokens=None, max_num_seqs=args.max_num_seqs)
    workload = Workload(**{**WORKLOAD.__dict__, "seed": args.seed})
    uneven = len(set(decode)) > 1
    began = time.monotonic()
    cap = args.capacity or capacity(pool, workload, 30.0)
    cap_share = [s / sum(pool.speeds) for s in pool.speeds]
    print(f"pods: decode ms/token {args.decode_ms}, max_num_seqs {args.max_num_seqs}, prefill "
          f"{args.prefill_ms} ms/token (fastest pod); capacity {cap:.2f} req/s "
          f"({'given' if args.capacity else 'measured, least request'}); endpoint_picker: "
          f"{json.dumps(args.picker)}; {args.duration:g} s of arrivals a mode, "
          f"{args.repeats} repeats, seed {args.seed}", flush=True)
    corpus = Corpus.of(workload)
    modes = {"least": None, "picker": args.picker}
    verdicts: list[bool] = []
    print("\n| load | req/s | mode | TTFT P50 ms | TTFT P99 ms | e2e P99 ms | req/s done | failed | "
          "shares (capacity share " + "/".join(f"{c:.0%}" for c in cap_share) + ") | "
          "extproc CPU ms/request | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary: list[str] = []
    for load in (float(x) for x in args.loads.split(",")):
        rate = load * cap
        requests = list(itertools.islice(script(workload, corpus, 0),
                                         int(rate * args.duration * 2) + 50))
        figures: dict[str, list[Figures]] = {"least": [], "picker": []}
        for repeat in range(args.repeats):
            order = ["least", "picker"] if repeat % 2 == 0 else ["picker", "least"]
            for key in order:
                report, _ = run_mode(key, modes[key], pool, partial(
                    open_loop, requests=requests, rate=rate, duration_s=args.duration,
                    seed=args.seed + repeat))
                f = Figures.of(report)
                figures[key].append(f)
                print(f"| {load:.0%} | {rate:.1f} | {key} #{repeat + 1} | {_ms(f.ttft_p50)} | "
                      f"{_ms(f.ttft_p99)} | {_ms(f.e2e_p99)} | {f.throughput:.2f} | {f.failed} | "
                      + "/".join(f"{s:.0%}" for s in f.shares) + f" | "
                      f"{report.extproc_cpu_s * 1000 / max(1, report.attempts):.2f} | "
                      f"{sum(report.load) / max(1, len(report.load)):.2f} |", flush=True)
        ratios = {name: statistics.median(getattr(p, name) / getattr(b, name)
                                          for p, b in zip(figures["picker"], figures["least"],
                                                          strict=True))
                  for name in ("ttft_p50", "ttft_p99", "e2e_p99", "throughput")}
        worst_share = min(statistics.median(f.shares[i] for f in figures["picker"]) / cap_share[i]
                          for i in range(len(cap_share)))
        failed = sum(f.failed for fs in figures.values() for f in fs)
        if uneven:
            ok = (ratios["ttft_p99"] <= 0.7 and ratios["ttft_p50"] <= 1.0
                  and ratios["e2e_p99"] <= 0.9 and ratios["throughput"] >= 0.97
                  and worst_share >= 0.5 and failed == 0)
        else:
            ok = (max(ratios["ttft_p50"], ratios["ttft_p99"], ratios["e2e_p99"]) <= 1.05
                  and ratios["throughput"] >= 1 / 1.05 and failed == 0)
        verdicts.append(ok)
        summary.append(f"| {load:.0%} | {rate:.1f} | {ratios['ttft_p99']:.2f} | "
                       f"{ratios['ttft_p50']:.2f} | {ratios['e2e_p99']:.2f} | "
                       f"{ratios['throughput']:.2f} | {worst_share:.2f} | {failed} | "
                       f"{'yes' if ok else 'NO'} |")
    print("\nMedians over repeats of picker / least request:\n")
    print("| load | req/s | TTFT P99 | TTFT P50 | e2e P99 | throughput | lowest pod share / "
          "capacity share | failed | done |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    print(f"\n{'uneven' if uneven else 'equal'} pods: "
          f"{'every load meets' if all(verdicts) else 'NOT every load meets'} issue 36's bar; "
          f"{time.monotonic() - began:.0f} s in all")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
