"""``python -m bench.picker_load``: the endpoint picker against Envoy's least request (issue 15).

    .venv/bin/python -m bench.picker_load [--quick] [--duration S] [--clients N] [--order least,picker]
        [--picker '{"weights": {"in_flight": 2}}']

One run measures the same workload twice through the whole gateway (real Envoy, extproc, four
simulated vLLM pods of uneven speed, started afresh for each mode so no cache carries over): the
pool with ``endpoint_picker: {}`` and the same pool without it (Envoy's least request). Clients
(asyncio + aiohttp, closed loop, streamed chats so the time to first token is the client's) follow
the scripts of :mod:`bench.picker_workload`; a 503 ``server_overloaded`` (the picker shedding a
low-priority request) is retried after its ``retry-after``, and its wait counts in the request's
latency. Requests are sent for ``--duration`` seconds; those still running then are finished
and count in the latencies, not in the throughput.

Per mode: completed requests, client TTFT and end-to-end P50/P99, requests/s and output tokens/s,
the pool's prefix-cache hit rate (the pods' ``vllm:prefix_cache_hits_total`` /
``_queries_total``), each pod's share of requests (``vllm:request_success_total``), extproc's CPU
per request (``/proc``) and the load average; then picker / least request. Everything, the load
generator included, shares the machine's cores, so compare the two modes of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
import orjson

from bench.acct import cpu_seconds
from bench.picker_workload import (
    Corpus,
    ModeReport,
    PodDelta,
    Request,
    Result,
    Workload,
    parse_counter,
    pod_table,
    script,
    table,
)
from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_http_ok
from tests.harness.gateway import Gateway, running_gateway

MODEL = "m"
MAX_CONTEXT = 8192
MAX_SHEDS = 5
"""503s a request waits out before the client gives up on it."""
IDLE_S = 5.0
"""Seconds extproc's CPU is measured with no traffic before the load."""


@dataclass(frozen=True)
class Pool:
    """The simulated pods: one speed each, the rest shared."""

    speeds: tuple[float, ...] = (2.0, 1.0, 1.0, 0.5)
    prefill_ms_per_token: float = 0.5
    decode_ms_per_token: float = 10.0
    kv_cache_tokens: int | None = 8192
    """None: the simulator's own default (8 x the model length)."""
    max_num_seqs: int | None = None
    """None: the simulator's own default (vLLM's 256)."""

    def sim_flags(self) -> list[str]:
        flags = ["--prefill-ms-per-token", str(self.prefill_ms_per_token),
                 "--decode-ms-per-token", str(self.decode_ms_per_token)]
        if self.kv_cache_tokens is not None:
            flags += ["--kv-cache-tokens", str(self.kv_cache_tokens)]
        if self.max_num_seqs is not None:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        return flags


@dataclass
class Pod:
    name: str
    speed: float
    url: str
    child: Child

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
        return text

    def counters(self) -> tuple[float, float, float]:
        text = self.metrics()
        requests = parse_counter(text, "vllm:request_success_total", skip='"abort"')
        return (requests, parse_counter(text, "vllm:prefix_cache_queries_total"),
                parse_counter(text, "vllm:prefix_cache_hits_total"))


@contextmanager
def running_pods(pool: Pool, workdir: str) -> Iterator[list[Pod]]:
    """Start one simulator per speed, wait until all answer ``/health``; stop them afterwards."""
    pods: list[Pod] = []
    try:
        for i, speed in enumerate(pool.speeds):
            port = free_port()
            name = f"pod{i}"
            child = start(f"sim {name}", sidecar_command(
                "sim", "--host", "127.0.0.1", "--port", str(port), "--name", name,
                "--max-model-len", str(MAX_CONTEXT), "--speed", str(speed), *pool.sim_flags(),
                "--no-dcgm"),
                log_path=os.path.join(workdir, f"sim-{name}.log"))
            pods.append(Pod(name, speed, f"http://127.0.0.1:{port}", child))
        for pod in pods:
            wait_http_ok(f"{pod.url}/health", 30, pod.child)
        yield pods
    finally:
        for pod in pods:
            pod.child.stop()


def gateway_doc(pods: list[Pod], picker: dict[str, Any] | None) -> dict[str, Any]:
    """The routing YAML: one pool of ``pods``, with ``endpoint_picker: PICKER`` unless None."""
    cluster: dict[str, Any] = {"endpoints": [p.url.removeprefix("http://") for p in pods],
                               "max_context": MAX_CONTEXT}
    if picker is not None:
        cluster["endpoint_picker"] = picker
    return {
        "version": 1,
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
        "services": {"extproc": f"127.0.0.1:{free_port()}"},
        "clusters": {"pool": cluster},
        "models": {MODEL: {"clusters": ["pool"], "default_max_tokens": 64}},
        # weight = prompt tokens x output / 1000: chats (<= ~2k x 96, <= ~200) are high, the
        # long asks (2.5k-3.2k x 256, >= ~640) low; vLLM's priority scheduling (simulated)
        # admits waiting chats first.
        "priority": {"high_below": 250, "low_from": 500, "inject": True},
    }


async def send(session: aiohttp.ClientSession, url: str, req: Request, t0: float) -> Result:
    loop = asyncio.get_running_loop()
    body = orjson.dumps(req.body(MODEL))
    started = loop.time()
    shed = 0
    status, pod, ttft, tokens = 599, None, None, 0
    while True:
        try:
            async with session.post(url, data=body,
                                    headers={"content-type": "application/json"}) as resp:
                status = resp.status
                if status == 503 and shed < MAX_SHEDS:
                    retry = float(resp.headers.get("retry-after", "1"))
                    await resp.read()
                    shed += 1
                    await asyncio.sleep(retry)
                    continue
                if status != 200:
                    await resp.read()
                    break
                pod = resp.headers.get("x-sim-name")
                done, ttft, tokens = await read_stream(resp, started)
                status = 200 if done else 599  # a cut stream is a failure
                break
        except (aiohttp.ClientError, TimeoutError):
            status = 599
            break
    return Result(req.kind, status, started - t0, loop.time() - t0, ttft, tokens, pod, shed)


async def read_stream(resp: aiohttp.ClientResponse, started: float
                      ) -> tuple[bool, float | None, int]:
    """Read a chat stream to its end (not just ``[DONE]``: the connection then goes back to the
    pool instead of being closed mid-response): whether ``[DONE]`` came, the seconds from
    ``started`` (the loop's time) to the first content, and the content chunks."""
    loop = asyncio.get_running_loop()
    done, ttft, tokens = False, None, 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        for choice in orjson.loads(payload).get("choices", ()):
            if choice.get("delta", {}).get("content"):
                tokens += 1
                if ttft is None:
                    ttft = loop.time() - started
    return done, ttft, tokens


@dataclass
class Load:
    results: list[Result]
    attempts: int
    window_s: float


async def drive(url: str, *, workload: Workload, clients: int, duration_s: float,
                per_client: int | None) -> Load:
    """Every client sends its script back to back until ``duration_s`` has passed (or it sent
    ``per_client`` requests); the requests running then are finished."""
    corpus = Corpus.of(workload)
    results: list[Result] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + duration_s
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        requests = script(workload, corpus, index)
        if per_client is not None:
            requests = itertools.islice(requests, per_client)
        for req in requests:
            if loop.time() >= deadline:
                return
            results.append(await send(session, url, req, t0))

    connector = aiohttp.TCPConnector(limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    attempts = len(results) + sum(r.shed for r in results)
    last = max((r.ended for r in results), default=duration_s)
    return Load(results, attempts, min(duration_s, last))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text: str = resp.read().decode()
    return text


async def _sample(pods: list[Pod], load: list[float],
                  states: dict[str, list[tuple[int, int, float]]], stop: asyncio.Event) -> None:
    """Every second: the machine's load average and each pod's real running/waiting/KV use."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            load.append(os.getloadavg()[0])
            for pod in pods:
                try:
                    async with session.get(f"{pod.url}/sim/state") as resp:
                        real = (await resp.json())["real"]
                except (aiohttp.ClientError, TimeoutError):
                    continue
                states[pod.name].append((real["running"], real["waiting"], real["kv_usage"]))
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


Driver = Callable[[str], Coroutine[Any, Any, "Load"]]
"""Sends a mode's requests to the chat URL it is given and returns what came back."""


async def _measured(url: str, pods: list[Pod], driver: Driver, load: list[float],
                    states: dict[str, list[tuple[int, int, float]]]) -> Load:
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(pods, load, states, stop))
    try:
        return await driver(url)
    finally:
        stop.set()
        await sampler


def pick_reasons(gw: Gateway) -> dict[str, float]:
    """The picker's decisions by reason (``llm_sidecar_endpoint_picks_total``), summed over pods."""
    reasons: dict[str, float] = {}
    for line in _get(f"{gw.extproc_metrics}/metrics").splitlines():
        if line.startswith("llm_sidecar_endpoint_picks_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return reasons


def run_mode(mode: str, picker: dict[str, Any] | None, pool: Pool,
             driver: Driver) -> tuple[ModeReport, dict[str, float]]:
    """One mode: fresh pods and gateway, ``driver``'s load through it, what each part did."""
    with ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"picker-load-{mode}-"))
        pods = stack.enter_context(running_pods(pool, work))
        gw = stack.enter_context(running_gateway(gateway_doc(pods, picker), work,
                                                 capture_logs=True))
        extproc = gw.child("extproc").process.pid
        # extproc's CPU with no traffic: with a picker, what scraping the pods costs.
        idle0 = cpu_seconds(extproc)
        time.sleep(IDLE_S)
        idle = (cpu_seconds(extproc) - idle0) / IDLE_S
        before = [pod.counters() for pod in pods]
        cpu0 = cpu_seconds(extproc)
        load: list[float] = []
        states: dict[str, list[tuple[int, int, float]]] = {pod.name: [] for pod in pods}
        done = asyncio.run(_measured(f"{gw.openai_base}/chat/completions", pods, driver, load,
                                     states))
        cpu = cpu_seconds(extproc) - cpu0
        after = [pod.counters() for pod in pods]
        deltas = [PodDelta(pod.name, pod.speed, a[0] - b[0], a[1] - b[1], a[2] - b[2],
                           tuple(states[pod.name]))
                  for pod, b, a in zip(pods, before, after, strict=True)]
        reasons = pick_reasons(gw) if picker is not None else {}
    return ModeReport(mode, done.window_s, done.results, deltas, cpu, done.attempts, load,
                      idle), reasons




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.picker_load",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 s a mode instead of 120 s")
    parser.add_argument("--duration", type=float, help="seconds of load per mode")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, help="at most this many requests per client")
    parser.add_argument("--seed", type=int, default=Workload.seed)
    parser.add_argument("--speeds", default="2.0,1.0,1.0,0.5", help="one pod per speed")
    parser.add_argument("--order", default="least,picker", help="which mode runs first")
    parser.add_argument("--picker", default="{}", type=json.loads,
                        help="the pool's endpoint_picker settings in the picker mode, as JSON")
    args = parser.parse_args(argv)
    duration = args.duration or (30.0 if args.quick else 120.0)
    pool = Pool(speeds=tuple(float(s) for s in args.speeds.split(",")))
    workload = Workload(seed=args.seed)
    modes: dict[str, tuple[str, dict[str, Any] | None]] = {
        "least": ("least request", None), "picker": ("picker", args.picker)}
    order = args.order.split(",")
    if sorted(order) != sorted(modes):
        parser.error(f"--order must name {' and '.join(modes)}")
    print(f"pods: speeds {pool.speeds}, prefill {pool.prefill_ms_per_token} ms/token, decode "
          f"{pool.decode_ms_per_token} ms/token (divided by speed), KV cache "
          f"{pool.kv_cache_tokens} tokens; {args.clients} clients, {duration:g} s a mode, seed "
          f"{args.seed}, order {args.order}, endpoint_picker: {json.dumps(args.picker)}; "
          f"load average at start {os.getloadavg()[0]:.2f}",
          flush=True)
    reports: dict[str, ModeReport] = {}
    for key in order:
        label, picker = modes[key]
        began = time.monotonic()
        reports[key], reasons = run_mode(
            label, picker, pool,
            partial(drive, workload=workload, clients=args.clients, duration_s=duration,
                    per_client=args.requests))
        extra = ("; picks by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items()))
                 if reasons else "")
        print(f"{label}: {len(reports[key].results)} requests in {time.monotonic() - began:.0f} s"
              f"{extra}", flush=True)
    print()
    print(table(reports["least"], reports["picker"]))
    for key in order:
        print(pod_table(reports[key]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
