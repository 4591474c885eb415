"""``python -m bench.flow_bound``: the quiet tenant of ``bench.flow_control`` (issue 37's third
bar) under a model gateway that never preempts, from a discrete-event model of the pool.

    .venv/bin/python -m bench.flow_bound [--max-num-seqs 6,12,24,48] [--decode-ms 15/15/15/15]
        [--prefill-ms 0.1] [--load 1.2] [--duration 400] [--max-wait 2] [--seeds 3]

The model gateway knows every pod's free slots exactly and costs nothing: a request goes the
instant a slot frees, to the fastest pod with one free. It keeps what the contract asks of flow
control (strict bands: the low band goes only while the high band is empty; ``max_wait`` ends a
wait; each tenant's requests in arrival order) and within a band it always serves the quiet
tenant first, the most any fairness rule can give it. A request holds its slot for its prefill
and its whole output budget at its pod's pace, as the simulator's pods do (a chat's shared
system prompt counted as cached, which only shortens the holds). Nothing is preempted: a pod's
sequences run to the end, as vLLM runs them while its KV cache has room (its priority
scheduling reorders the waiting, it does not stop the running).

On equal pods that makes the quiet tenant's TTFT in the model (its wait plus its own unloaded
TTFT) a lower bound for any gateway that keeps every slot busy and the contract's order. It is
not one for gateways that hold slots back (throughput), nor on pods of uneven speed, where
sending each request to the fastest free pod is not the best dispatch (the real picker beat the
model there). ``bench.flow_control`` prints it next to the measured figure (the same arrivals,
the unloaded TTFTs of its ``alone`` run); this command sweeps pool shapes with the unloaded TTFT
taken as prefill plus one token, to show at which sequences per pod the bar of 2x unloaded comes
within reach. Pure: no processes, no clock.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.picker_workload import Workload, percentile


@dataclass(frozen=True)
class Job:
    """One request as the model sees it."""

    at: float
    """Arrival, seconds from the start."""
    band: int
    """0: high, 1: low."""
    quiet: bool
    hold_s: float
    """Seconds it holds a slot on a pod of speed 1 (the fastest)."""


def hold_seconds(prompt_tokens: int, cached_tokens: int, output_tokens: int, *,
                 prefill_s: float, decode_s: float) -> float:
    """A request's time on a pod of speed 1: prefill of its uncached prompt, then its output."""
    return max(prompt_tokens - cached_tokens, 0) * prefill_s + output_tokens * decode_s


def model_waits(jobs: Sequence[Job], speeds: Sequence[float], slots_per_pod: int,
                max_wait_s: float) -> list[float | None]:
    """Each job's wait for a slot in the model gateway (None: refused, ``max_wait_s`` passed),
    in the order of ``jobs`` (sorted by arrival)."""
    free = [slots_per_pod] * len(speeds)
    fastest_first = sorted(range(len(speeds)), key=lambda pod: -speeds[pod])
    ends: list[tuple[float, int]] = []
    lines: tuple[tuple[deque[int], deque[int]], ...] = ((deque(), deque()), (deque(), deque()))
    waits: list[float | None] = [None] * len(jobs)

    def head(now: float) -> int | None:
        for band in lines:
            for line in band:  # the quiet tenant's line first
                while line and now - jobs[line[0]].at > max_wait_s:
                    line.popleft()  # refused: its wait ran out
                if line:
                    return line.popleft()
        return None

    def dispatch(now: float) -> None:
        while True:
            pod = next((p for p in fastest_first if free[p] > 0), None)
            if pod is None:
                return
            index = head(now)
            if index is None:
                return
            free[pod] -= 1
            waits[index] = now - jobs[index].at
            heapq.heappush(ends, (now + jobs[index].hold_s / speeds[pod], pod))

    arriving = 0
    while arriving < len(jobs) or ends:
        if ends and (arriving == len(jobs) or ends[0][0] <= jobs[arriving].at):
            now, pod = heapq.heappop(ends)
            free[pod] += 1
        else:
            job = jobs[arriving]
            now = job.at
            lines[job.band][0 if job.quiet else 1].append(arriving)
            arriving += 1
        dispatch(now)
    return waits


def quiet_ttfts(jobs: Sequence[Job], waits: Sequence[float | None],
                unloaded: Sequence[float | None]) -> list[float]:
    """The quiet tenant's TTFTs in the model: its wait plus its own ``unloaded`` TTFT (one per
    job, None where unknown); refused requests and unknown ones are left out."""
    return [wait + alone for job, wait, alone in zip(jobs, waits, unloaded, strict=True)
            if job.quiet and wait is not None and alone is not None]


def synthetic(workload: Workload, *, rate: float, duration_s: float, seed: int,
              prefill_s: float, decode_s: float) -> tuple[list[Job], list[float]]:
    """Jobs of ``bench.flow_control``'s plan at ``rate`` and, for each, its unloaded TTFT on the
    fastest pod (prefill plus one token)."""
    from bench.flow_control import cached_tokens, model_job, plan  # it imports this module

    jobs: list[Job] = []
    unloaded: list[float] = []
    for arrival in plan(workload, rate=rate, duration_s=duration_s, seed=seed):
        req = arrival.request
        jobs.append(model_job(arrival, workload, prefill_s=prefill_s, decode_s=decode_s))
        unloaded.append(hold_seconds(req.prompt_tokens, cached_tokens(req, workload), 1,
                                     prefill_s=prefill_s, decode_s=decode_s))
    return jobs, unloaded


def main(argv: list[str] | None = None) -> int:
    from bench.flow_control import WORKLOAD

    parser = argparse.ArgumentParser(prog="python -m bench.flow_bound",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-num-seqs", default="6,12,24,48",
                        help="sequences per pod, one model pool each (default 6,12,24,48)")
    parser.add_argument("--decode-ms", default="15/15/15/15")
    parser.add_argument("--prefill-ms", type=float, default=0.1)
    parser.add_argument("--load", type=float, default=1.2)
    parser.add_argument("--duration", type=float, default=400.0)
    parser.add_argument("--max-wait", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    decode = [float(d) for d in args.decode_ms.split("/")]
    speeds = [min(decode) / d for d in decode]
    prefill_s, decode_s = args.prefill_ms / 1000, min(decode) / 1000
    print(f"model pools of {len(speeds)} pods (decode ms/token {args.decode_ms}), load "
          f"{args.load:.0%} of each pool's model capacity, {args.duration:g} s of arrivals, "
          f"seeds {WORKLOAD.seed} to {WORKLOAD.seed + args.seeds - 1}\n")
    print("| seqs/pod | capacity req/s | quiet TTFT P99 unloaded ms | with the model gateway ms "
          "| ratio (median of seeds) |")
    print("|---|---|---|---|---|")
    for seqs in (int(s) for s in args.max_num_seqs.split(",")):
        probe, _ = synthetic(WORKLOAD, rate=10.0, duration_s=200.0, seed=WORKLOAD.seed,
                             prefill_s=prefill_s, decode_s=decode_s)
        mean_hold = statistics.fmean(j.hold_s for j in probe)
        cap = sum(speeds) * seqs / mean_hold
        ratios: list[float] = []
        loaded: list[float] = []
        alone: list[float] = []
        for k in range(args.seeds):
            jobs, unloaded = synthetic(WORKLOAD, rate=args.load * cap, duration_s=args.duration,
                                       seed=WORKLOAD.seed + k, prefill_s=prefill_s,
                                       decode_s=decode_s)
            waits = model_waits(jobs, speeds, seqs, args.max_wait)
            loaded.append(percentile(quiet_ttfts(jobs, waits, unloaded), 99))
            alone.append(percentile([u for j, u in zip(jobs, unloaded, strict=True)
                                     if j.quiet], 99))
            ratios.append(loaded[-1] / alone[-1])
        print(f"| {seqs} | {cap:.1f} | {statistics.median(alone) * 1000:.0f} | "
              f"{statistics.median(loaded) * 1000:.0f} | {statistics.median(ratios):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
