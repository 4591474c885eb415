"""``python -m bench.picker``: the CPU cost of one endpoint pick (issue 15: <= 100 us for 64 pods).

One pool of 64 pods with fresh, varied metrics (and four paces); 8 KB prompts asking for 32 to
256 tokens, each one of 32 shared 2 KB system
prompts followed by 6 KB of its own text, a quarter of them repeated (a conversation's next
turn), so the prefix index both matches and records; every pick is ended with ``done``, and the
pods are re-scraped every 100 picks as the scraper would. The figure is CPU time per
``pick`` + ``done`` (``time.process_time``), median of the rounds; on a shared machine the
minimum is the better guide to what the code costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter

from extproc.picker.pick import EndpointPicker
from extproc.picker.scoring import Work
from extproc.picker.state import PodMetrics
from routing.schema import RoutingConfig

PODS = 64
PROMPT_BYTES = 8192
SYSTEM_BYTES = 2048


def _config(pods: int) -> RoutingConfig:
    endpoints = [f"10.1.{i // 250}.{i % 250 + 1}:8000" for i in range(pods)]
    return RoutingConfig.model_validate({
        "version": 1,
        "clusters": {"pool": {"endpoints": endpoints, "max_context": 32768, "endpoint_picker": {}}},
        "models": {"m": {"clusters": ["pool"]}},
    })


def _prompts(rng: random.Random, count: int) -> list[bytes]:
    systems = [rng.randbytes(SYSTEM_BYTES) for _ in range(32)]
    fresh = [rng.choice(systems) + rng.randbytes(PROMPT_BYTES - SYSTEM_BYTES) for _ in range(count)]
    # A quarter are repeats of an earlier prompt (the next turn of a conversation).
    return [rng.choice(fresh[: i + 1]) if rng.random() < 0.25 else p for i, p in enumerate(fresh)]


def _scrape(picker: EndpointPicker, rng: random.Random, now: float) -> None:
    pool = picker.pools["pool"]
    for i, address in enumerate(pool.pods):
        # Token counters that grow, so each pod's pace is measured (pods of 4 speeds).
        tokens = 1000.0 * (now * 10 + 1)
        pool.record_scrape(address, PodMetrics(waiting=rng.randint(0, 8), running=rng.randint(0, 64),
                                               kv_usage=rng.random() * 0.9,
                                               token_gap_sum=tokens * 0.01 * (1 + i % 4),
                                               token_gap_count=tokens), now)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(picks: int, rounds: int, pods: int) -> tuple[list[float], Counter[str]]:
    rng = random.Random(15)
    prompts = _prompts(rng, picks)
    works = [Work(len(prompt) // 4, rng.randint(32, 256)) for prompt in prompts]
    per_pick: list[float] = []
    reasons: Counter[str] = Counter()
    for _ in range(rounds):
        clock = _Clock()
        picker = EndpointPicker(_config(pods), clock=clock, rng=random.Random(1))
        _scrape(picker, rng, clock.now)
        elapsed = 0.0
        for i, (prompt, work) in enumerate(zip(prompts, works, strict=True)):
            if i % 100 == 0:
                clock.now += 0.1
                _scrape(picker, rng, clock.now)
            start = time.process_time()
            pick = picker.pick("pool", prompt, "medium", work=work)
            assert pick is not None and pick.endpoint is not None
            picker.done("pool", pick.endpoint)
            elapsed += time.process_time() - start
            reasons[pick.reason] += 1
        per_pick.append(elapsed / picks * 1e6)
    return per_pick, reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.picker", description=__doc__.splitlines()[0])
    parser.add_argument("--picks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pods", type=int, default=PODS)
    args = parser.parse_args(argv)
    per_pick, reasons = run(args.picks, args.rounds, args.pods)
    print(f"{args.pods} pods, {PROMPT_BYTES} B prompts, {args.picks} picks x {args.rounds} rounds: "
          f"median {statistics.median(per_pick):.1f} us per pick (min {min(per_pick):.1f}, "
          f"max {max(per_pick):.1f}) of CPU")
    print("reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
