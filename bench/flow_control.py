"""``python -m bench.flow_control``: a pool at 120% of its capacity with and without flow control,
two tenants and two priority tiers, open loop (issue 37).

    .venv/bin/python -m bench.flow_control [--decode-ms 15/15/15/15] [--max-num-seqs 6]
        [--load 1.2] [--repeats 3] [--duration 40] [--capacity REQ_PER_S]
        [--flow-control '{}'] [--prefill-ms 0.1] [--seed 37] [--fcfs-pods] [--learn-capacity]

Pods: one simulator per ``--decode-ms`` entry (milliseconds per output token; ``15/15/15/15`` is
four equal pods, ``15/15/22.5/45`` two at full speed, one 1.5x and one 3x slower), each running at
most ``--max-num-seqs`` sequences (the rest wait, lowest ``priority`` first, as vLLM's priority
scheduling; first come, first served with ``--fcfs-pods``), prefill ``--prefill-ms`` per
uncached prompt token on the fastest pod.

Workload: one seeded script of streamed chats (:mod:`bench.picker_workload`), the same in both
modes: 30% ``high`` (a ~250-token prompt, one of 8 shared system prompts, 16 to 32 output tokens;
weight under ``priority.high_below`` = 20) and 70% ``low`` (a 600- to 1,000-token document of its
own, 96 to 160 output tokens; weight from ``priority.low_from`` = 50 on); each request from the loud
tenant or, one in eleven, the quiet one (10:1 by requests, the same tier mix), named by its API
key. Arrivals are Poisson at ``--load`` x capacity for ``--duration`` seconds. Clients do not
retry: a 503 or 429 with ``retry-after`` is *refused*; any other answer but a whole stream (no
answer, a cut stream, another status, a 503 without ``retry-after``, a timeout) is *lost*.

Capacity: what Envoy's least request completes per second with twice as many closed-loop clients
as the pool has sequence slots (:func:`bench.picker_capacity.capacity`; ``--capacity`` skips it).
Per repeat, on fresh pods and a fresh gateway each, in alternating order: ``endpoint_picker: {}``
(``noflow``: a low-priority request gets 503 when every pod is saturated, the rest pile onto the
pods' queues) and ``endpoint_picker: {flow_control: FLOW}`` (``flow``); then the quiet tenant's
requests alone, at the same times, with flow control (``alone``: its unloaded figures). Every
mode's picker is told the pods' ``max_num_seqs`` (``endpoint_picker.max_num_seqs``, as
``llm-sidecar onboard`` writes it) unless ``--learn-capacity``.

Per run: completed, refused and lost requests, completed requests/s and output tokens/s (those
that ended within the window of arrivals), client TTFT P50/P99 of each tier and of the quiet
tenant (completed requests only), how many answers carried ``x-llm-queued-ms`` and the P99 of
the quiet tenant's (0 where absent: the part of its TTFT spent waiting in extproc). Then the
medians over repeats and issue 37's bar, checked on them: with flow control, high-tier TTFT P99
<= 0.5x the run without it, the quiet tenant's TTFT P99 <= 2x its unloaded figure, no request
lost, and throughput >= 0.97x in requests/s and in output tokens/s (requests alone would flatter a
mode that refuses the long ones). The exit status is 1 when a bar fails. Everything shares the
machine's cores: compare the modes of one run, never figures of two runs.

Beside the quiet tenant's bar it prints the same figure under :mod:`bench.flow_bound`'s model
gateway (never preempts, knows every slot, costs nothing; its wait plus the same request's TTFT
alone), fed the same pool and arrivals: on equal pods, a lower bound for any gateway that keeps
every slot busy and the contract's order.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiohttp
import orjson

from bench.flow_bound import Job, hold_seconds, model_waits, quiet_ttfts
from bench.picker_capacity import capacity
from bench.picker_load import IDLE_S, MODEL, Pod, Pool, gateway_doc, read_stream, running_pods
from bench.picker_workload import Corpus, Request, Workload, parse_counter, percentile, script
from routing.picker_schema import FlowControlSpec
from tests.harness.gateway import running_gateway

WORKLOAD = Workload(seed=37, groups=8, system_tokens=200, turns=(1, 1), user_tokens=(20, 60),
                    chat_max_tokens=(16, 32), long_share=0.7, long_tokens=(600, 1000),
                    long_max_tokens=128)
"""Issue 37's two tiers: ``chat`` requests are the high tier, ``long`` ones the low tier."""
PRIORITY = {"high_below": 20, "low_from": 50, "inject": True}
"""Chats weigh at most ~(200 + 60 + 10) x 32 / 1000 < 9, long asks at least 600 x 96 / 1000.
``inject``: the pods schedule by priority (vLLM's ``--scheduling-policy priority``), so without
flow control a high-priority request still overtakes the low ones waiting on its pod;
``--fcfs-pods`` turns it off (first come, first served on the pods)."""
TIER = {"chat": "high", "long": "low"}
KEYS = {"loud": "sk-bench-flow-loud", "quiet": "sk-bench-flow-quiet"}
LOW_MAX_TOKENS = (96, 160)
"""A long ask's output budget: one length for all (the script's ``long_max_tokens``) would have
the pods, full from the start, finish and refill their slots in lockstep for the whole run, so
that room comes in bursts with long gaps between them (real outputs vary in length)."""
QUIET_SHARE = 1 / 11
"""The quiet tenant's share of the requests: the loud one sends 10 times as many."""
SOCK_READ_S = 60.0
"""A stream silent this long is lost."""

Tenant = Literal["loud", "quiet"]
Verdict = Literal["completed", "refused", "lost"]


@dataclass(frozen=True)
class Arrival:
    at: float
    """Seconds from the start of the window."""
    tenant: Tenant
    request: Request


def plan(workload: Workload, *, rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """The script's requests at Poisson arrivals of ``rate`` per second for ``duration_s``, each
    drawn to a tenant, each long ask's output budget drawn from :data:`LOW_MAX_TOKENS` (the same
    for the same arguments)."""
    rng = random.Random(seed)
    budgets = random.Random(f"{seed}/max_tokens")
    out: list[Arrival] = []
    at = rng.expovariate(rate)
    for req in script(workload, Corpus.of(workload), 0):
        if at >= duration_s:
            return out
        if req.kind == "long":
            req = replace(req, max_tokens=budgets.randint(*LOW_MAX_TOKENS))
        out.append(Arrival(at, "quiet" if rng.random() < QUIET_SHARE else "loud", req))
        at += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it (times in seconds from the start of the window)."""

    tenant: Tenant
    tier: str
    status: int
    """The HTTP status; 599: no answer or a cut stream."""
    retry_after: bool
    ended: float
    ttft: float | None
    output_tokens: int
    queued_s: float | None
    """The answer's ``x-llm-queued-ms`` (in seconds): how long extproc held it; None: not held."""

    @property
    def verdict(self) -> Verdict:
        if self.status == 200:
            return "completed"
        if self.status in (429, 503) and self.retry_after:
            return "refused"
        return "lost"


async def send(session: aiohttp.ClientSession, url: str, arrival: Arrival, t0: float) -> Outcome:
    """Send one streamed chat once, with its tenant's key; read its answer to the end."""
    loop = asyncio.get_running_loop()
    body = orjson.dumps(arrival.request.body(MODEL))
    headers = {"content-type": "application/json",
               "authorization": f"Bearer {KEYS[arrival.tenant]}"}
    started = loop.time()
    status, retry_after, ttft, tokens = 599, False, None, 0
    queued_s: float | None = None
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            retry_after = "retry-after" in resp.headers
            if (held := resp.headers.get("x-llm-queued-ms")) is not None:
                queued_s = float(held) / 1000
            if resp.status != 200:
                status = resp.status
                await resp.read()
            else:
                done, ttft, tokens = await read_stream(resp, started)
                if done:
                    status = 200  # else a cut stream is lost
    except (aiohttp.ClientError, TimeoutError):
        status = 599
    return Outcome(arrival.tenant, TIER[arrival.request.kind], status, retry_after,
                   loop.time() - t0, ttft, tokens, queued_s)


async def open_loop(url: str, arrivals: Sequence[Arrival]) -> list[Outcome]:
    """Send each arrival at its time; wait for every answer."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=SOCK_READ_S)
    tasks: list[asyncio.Task[Outcome]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0 = loop.time()
        for arrival in arrivals:
            delay = t0 + arrival.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, arrival, t0)))
        return list(await asyncio.gather(*tasks))


def routing_doc(pods: list[Pod], flow: dict[str, Any] | None,
                priority: dict[str, Any] | None = None,
                declared: int | None = None) -> dict[str, Any]:
    """:func:`bench.picker_load.gateway_doc` with the picker (and ``flow_control: FLOW`` unless
    None; ``max_num_seqs: DECLARED`` unless None), the two tenants' keys and ``priority``
    (default :data:`PRIORITY`)."""
    picker: dict[str, Any] = {} if flow is None else {"flow_control": flow}
    if declared is not None:
        picker["max_num_seqs"] = declared
    doc = gateway_doc(pods, picker)
    doc["priority"] = dict(PRIORITY if priority is None else priority)
    doc["api_keys"] = [{"name": f"bench-{tenant}", "tenant": tenant,
                        "sha256": hashlib.sha256(key.encode()).hexdigest()}
                       for tenant, key in KEYS.items()]
    return doc


@dataclass(frozen=True)
class Run:
    mode: str
    outcomes: list[Outcome]
    window_s: float
    flow_rejected: float
    """``llm_sidecar_flow_rejected_total``, every reason."""

    def count(self, verdict: Verdict) -> int:
        return sum(1 for o in self.outcomes if o.verdict == verdict)

    def done(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and o.ended <= self.window_s]

    def req_s(self) -> float:
        return len(self.done()) / self.window_s

    def tok_s(self) -> float:
        return sum(o.output_tokens for o in self.done()) / self.window_s

    def ttft(self, q: float, keep: Callable[[Outcome], bool]) -> float:
        return percentile([o.ttft for o in self.outcomes
                           if o.status == 200 and o.ttft is not None and keep(o)], q)

    def figures(self) -> dict[str, float]:
        """The figures the tables show, by name."""
        def high(o: Outcome) -> bool:
            return o.tier == "high"

        def low(o: Outcome) -> bool:
            return o.tier == "low"

        def quiet(o: Outcome) -> bool:
            return o.tenant == "quiet"

        return {"completed": self.count("completed"), "refused": self.count("refused"),
                "lost": self.count("lost"), "req/s": self.req_s(), "tok/s": self.tok_s(),
                "high P50": self.ttft(50, high), "high P99": self.ttft(99, high),
                "low P50": self.ttft(50, low), "low P99": self.ttft(99, low),
                "quiet P50": self.ttft(50, quiet), "quiet P99": self.ttft(99, quiet),
                "queued": sum(1 for o in self.outcomes if o.queued_s is not None),
                "quiet held P99": percentile([o.queued_s or 0.0 for o in self.outcomes
                                              if o.status == 200 and quiet(o)], 99),
                "quiet refused": sum(1 for o in self.outcomes
                                     if o.tenant == "quiet" and o.verdict == "refused")}


def cached_tokens(request: Request, workload: Workload) -> int:
    """Prompt tokens of ``request`` a pod's prefix cache supplies in :mod:`bench.flow_bound`'s
    model: a chat's shared system prompt (which only shortens the model's holds)."""
    return workload.system_tokens if request.kind == "chat" else 0


def model_job(arrival: Arrival, workload: Workload, *, prefill_s: float, decode_s: float) -> Job:
    """``arrival`` as :mod:`bench.flow_bound`'s model sees it."""
    req = arrival.request
    return Job(arrival.at, 0 if TIER[req.kind] == "high" else 1, arrival.tenant == "quiet",
               hold_seconds(req.prompt_tokens, cached_tokens(req, workload), req.max_tokens,
                            prefill_s=prefill_s, decode_s=decode_s))


def bound_p99(pool: Pool, workload: Workload, arrivals: Sequence[Arrival], alone: Run,
              max_wait_s: float) -> float:
    """The quiet tenant's TTFT P99 in :mod:`bench.flow_bound`'s model of ``pool`` for
    ``arrivals``, each quiet request's unloaded TTFT taken from the ``alone`` run."""
    jobs = [model_job(a, workload, prefill_s=pool.prefill_ms_per_token / 1000,
                      decode_s=pool.decode_ms_per_token / 1000) for a in arrivals]
    alone_ttfts = iter(o.ttft if o.status == 200 else None for o in alone.outcomes)
    unloaded = [next(alone_ttfts) if job.quiet else None for job in jobs]
    waits = model_waits(jobs, pool.speeds, pool.max_num_seqs or 256, max_wait_s)
    return percentile(quiet_ttfts(jobs, waits, unloaded), 99)


def run(mode: str, flow: dict[str, Any] | None, pool: Pool, arrivals: Sequence[Arrival],
        duration_s: float, priority: dict[str, Any], declared: int | None) -> Run:
    """One run: fresh pods and gateway, ``arrivals`` through it."""
    with ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"flow-control-{mode}-"))
        pods = stack.enter_context(running_pods(pool, work))
        gw = stack.enter_context(running_gateway(routing_doc(pods, flow, priority, declared), work,
                                                 capture_logs=True))
        time.sleep(IDLE_S)  # the picker's first scrapes of every pod
        outcomes = asyncio.run(open_loop(f"{gw.openai_base}/chat/completions", arrivals))
        with urllib.request.urlopen(f"{gw.extproc_metrics}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    return Run(mode, outcomes, duration_s,
               parse_counter(metrics, "llm_sidecar_flow_rejected_total"))


COLUMNS = ("completed", "refused", "lost", "req/s", "tok/s", "high P50", "high P99", "low P50",
           "low P99", "quiet P50", "quiet P99", "queued", "quiet held P99", "quiet refused")
MS = {"high P50", "high P99", "low P50", "low P99", "quiet P50", "quiet P99", "quiet held P99"}


def _cell(name: str, value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if name in MS:
        return f"{value * 1000:.0f}"
    return f"{value:.2f}" if name.endswith("/s") else f"{value:.0f}"


def _row(label: str, figures: dict[str, float]) -> str:
    return f"| {label} | " + " | ".join(_cell(c, figures[c]) for c in COLUMNS) + " |"


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flow_control",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--decode-ms", default="15/15/15/15",
                        help="ms per output token, one pod each (default 15/15/15/15)")
    parser.add_argument("--max-num-seqs", type=int, default=6)
    parser.add_argument("--prefill-ms", type=float, default=0.1,
                        help="ms per uncached prompt token on the fastest pod (default 0.1)")
    parser.add_argument("--load", type=float, default=1.2, help="share of the capacity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals a run")
    parser.add_argument("--capacity", type=float, help="req/s; default: measured first")
    parser.add_argument("--flow-control", default="{}", type=json.loads,
                        help="the pool's flow_control settings in the flow mode, as JSON")
    parser.add_argument("--seed", type=int, default=WORKLOAD.seed)
    parser.add_argument("--learn-capacity", action="store_true",
                        help="the picker is not told the pods' max_num_seqs "
                             "(endpoint_picker.max_num_seqs): it learns it from their metrics")
    parser.add_argument("--fcfs-pods", action="store_true",
                        help="no priority.inject: the pods serve first come, first served")
    args = parser.parse_args(argv)
    priority = {**PRIORITY, "inject": not args.fcfs_pods}
    declared = None if args.learn_capacity else args.max_num_seqs
    decode = [float(d) for d in args.decode_ms.split("/")]
    fastest = min(decode)
    pool = Pool(speeds=tuple(fastest / d for d in decode), prefill_ms_per_token=args.prefill_ms,
                decode_ms_per_token=fastest, kv_cache_tokens=None, max_num_seqs=args.max_num_seqs)
    workload = Workload(**{**WORKLOAD.__dict__, "seed": args.seed})
    began = time.monotonic()
    cap = args.capacity or capacity(pool, workload, 30.0)
    rate = args.load * cap
    print(f"pods: decode ms/token {args.decode_ms}, max_num_seqs {args.max_num_seqs}, prefill "
          f"{args.prefill_ms} ms/token (fastest pod); capacity {cap:.2f} req/s "
          f"({'given' if args.capacity else 'measured, least request'}); load {args.load:.0%} = "
          f"{rate:.1f} req/s; flow_control: {json.dumps(args.flow_control)}; priority "
          f"{json.dumps(priority)}; endpoint_picker.max_num_seqs: {declared}; "
          f"{args.duration:g} s of arrivals a run, {args.repeats} repeats, seed {args.seed}",
          flush=True)
    modes: dict[str, dict[str, Any] | None] = {"noflow": None, "flow": args.flow_control}
    runs: dict[str, list[dict[str, float]]] = {"noflow": [], "flow": [], "alone": []}
    bounds: list[float] = []
    max_wait_s = FlowControlSpec.model_validate(args.flow_control).max_wait_s
    print("\nTTFT in ms (completed requests); req/s and tok/s: completed within the window\n")
    print("| run | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for repeat in range(args.repeats):
        arrivals = plan(workload, rate=rate, duration_s=args.duration, seed=args.seed + repeat)
        order = ["noflow", "flow"] if repeat % 2 == 0 else ["flow", "noflow"]
        for mode in order:
            r = run(mode, modes[mode], pool, arrivals, args.duration, priority, declared)
            runs[mode].append(r.figures())
            print(_row(f"{mode} #{repeat + 1} ({len(arrivals)} sent, {r.flow_rejected:.0f} flow "
                       "refusals)", runs[mode][-1]), flush=True)
        quiet = [a for a in arrivals if a.tenant == "quiet"]
        r = run("alone", args.flow_control, pool, quiet, args.duration, priority, declared)
        runs["alone"].append(r.figures())
        print(_row(f"quiet alone #{repeat + 1} ({len(quiet)} sent)", runs["alone"][-1]),
              flush=True)
        bounds.append(bound_p99(pool, workload, arrivals, r, max_wait_s))
        print(f"| model gateway #{repeat + 1} (bench.flow_bound) | quiet P99 "
              f"{bounds[-1] * 1000:.0f} ms = {_ratio(bounds[-1], runs['alone'][-1]['quiet P99']):.2f}"
              " x alone |", flush=True)

    print("\nMedians over repeats:\n")
    print("| mode | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for mode, figs in runs.items():
        print(_row(mode, {c: statistics.median(f[c] for f in figs) for c in COLUMNS}))
    pairs = list(zip(runs["flow"], runs["noflow"], runs["alone"], strict=True))
    ratios = {c: statistics.median(_ratio(f[c], n[c]) for f, n, _ in pairs)
              for c in ("req/s", "tok/s", "high P50", "high P99", "low P50", "low P99",
                        "quiet P50", "quiet P99")}
    print("\nflow / noflow, median of the repeats' ratios: "
          + ", ".join(f"{c} {v:.2f}" for c, v in ratios.items()))
    quiet_ratio = statistics.median(_ratio(f["quiet P99"], a["quiet P99"]) for f, _, a in pairs)
    bound_ratio = statistics.median(_ratio(b, a["quiet P99"])
                                    for b, a in zip(bounds, runs["alone"], strict=True))
    lost = sum(int(f["lost"]) for f in runs["flow"]) + sum(int(a["lost"]) for a in runs["alone"])
    bars = [
        (f"high-tier TTFT P99 flow / noflow {ratios['high P99']:.2f} <= 0.5",
         ratios["high P99"] <= 0.5),
        (f"quiet tenant TTFT P99 flow / alone {quiet_ratio:.2f} <= 2 (bench.flow_bound's model "
         f"gateway: {bound_ratio:.2f})", quiet_ratio <= 2.0),
        (f"requests lost with flow control {lost} == 0 (noflow lost "
         f"{sum(int(n['lost']) for n in runs['noflow'])})", lost == 0),
        (f"throughput flow / noflow {ratios['req/s']:.2f} req/s, {ratios['tok/s']:.2f} tok/s "
         ">= 0.97", ratios["req/s"] >= 0.97 and ratios["tok/s"] >= 0.97),
    ]
    print("\nIssue 37's bar:\n")
    for text, ok in bars:
        print(f"- {'yes' if ok else 'NO '} {text}")
    passed = all(ok for _, ok in bars)
    print(f"\n{'every bar met' if passed else 'NOT every bar met'}; "
          f"{time.monotonic() - began:.0f} s in all")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
