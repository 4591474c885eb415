"""What a streamed answer costs the gateway, before and after issue 16, in one run.

    .venv/bin/python -m bench.stream_cost [--requests 200] [--streams 60] [--concurrency 8]
        [--samples 1,0.1,0.02,0] [--floors 5] [--settle-batch-ms 5] [--rate R]
        [--workloads json16,sse16,sse256,sse256+usage]

Runs the whole gateway (real Envoy, extproc, ratelimit on memory, simulators) once per
``telemetry.sample`` (``--samples``, default 1, 0.1, 0.02, 0): 1 is extproc reading every response,
as before issue 16; below it Envoy reads the usage of the unsampled rest. In each run it sends,
one workload after another:

* ``json16``: chat, 16 tokens, not streamed;
* ``sse256``: chat, 256 tokens streamed, one SSE event per token (1 ms apart, so Envoy forwards
  each as its own body chunk, as from a decoding vLLM pod), without ``stream_options``;
* ``sse256+usage``: the same with ``stream_options.include_usage`` (without it, unsampled
  streams get it added and the chunk stripped by Envoy's Lua filter);
* ``sse16`` (only when ``--workloads`` names it): 16 tokens streamed, short enough to pace at
  hundreds a second on a small machine.

``--floors 0,5`` runs each sample once per ``telemetry.sample_min_per_s`` (issue 35; 0: the
share alone, as before it; default 5, the config's default).

For each: CPU per request of extproc, ratelimit and Envoy (``/proc``, children included), ext_proc
messages per request (Envoy's ``ext_proc.stream_msgs_sent``), rate-limit calls per request (the
service's ``ratelimit_requests_total``: Envoy's admissions and stream-done calls, extproc's
settlement batches), and the load average of the machine (shared: other processes' CPU shows up
as load, not in these numbers). ``--settle-batch-ms 0,5`` runs each sample twice: Envoy settling
every request (0), and extproc batching the settlements of what it read (5, the default).

By default each workload runs closed-loop (``--concurrency`` requests in flight), so the short
answers come at many times the rate of the streams (each ~0.27 s long), and a service's CPU
per request falls with its load (several messages per read, write and loop iteration).
``--rate R`` paces every workload at R requests/s instead (``--concurrency`` threads must be
enough to keep it: R times a request's duration), so the workloads are compared at one load.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from bench.acct import cpu_seconds
from tests.harness.gateway import Gateway, default_doc, running_gateway

WORKLOADS: dict[str, dict[str, Any]] = {
    "json16": {"max_tokens": 16},
    "sse256": {"max_tokens": 256, "stream": True},
    "sse256+usage": {"max_tokens": 256, "stream": True,
                     "stream_options": {"include_usage": True}},
    "sse16": {"max_tokens": 16, "stream": True},
}
DEFAULT_WORKLOADS = "json16,sse256,sse256+usage"


def _doc(sample: float, floor: int = 5) -> dict[str, Any]:
    d = default_doc()
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 1, "prefill_ms_per_token": 0}
    d["telemetry"] = {"sample": sample, "sample_min_per_s": floor}
    d["rate_limits"] = {"tenant": {"default": {"requests": "1M/s", "tokens": "1000M/s"}}}
    return d


def _one(gw: Gateway, body: dict[str, Any]) -> None:
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hello"}], **body}),
            {"content-type": "application/json", "x-tenant-id": "bench"})
        response = conn.getresponse()
        data = response.read()
        assert response.status == 200, data[:200]
    finally:
        conn.close()


def _msgs(gw: Gateway) -> float:
    with urllib.request.urlopen(f"{gw.admin_url}/stats?filter=ext_proc.stream_msgs_sent",
                                timeout=5) as resp:
        return sum(float(line.rsplit(":", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.strip())


def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _rls_calls(gw: Gateway) -> float:
    return _metric(gw.ratelimit_metrics, "ratelimit_requests_total")


def _settled(gw: Gateway) -> float:
    return _metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens")


def _pids(gw: Gateway) -> dict[str, int]:
    return {name: gw.child(name).process.pid for name in ("extproc", "ratelimit", "envoy")}


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


@dataclass(frozen=True)
class Load:
    concurrency: int
    rate: float = 0.0
    """Requests per second to pace at; 0: closed loop, ``concurrency`` in flight."""


def send(gw: Gateway, body: dict[str, Any], count: int, load: Load) -> float:
    """``count`` requests as ``load`` says; the seconds they took."""
    started = time.monotonic()

    def one(i: int) -> None:
        if load.rate > 0:
            delay = started + i / load.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        _one(gw, body)

    with ThreadPoolExecutor(load.concurrency) as pool:
        list(pool.map(one, range(count)))
    return time.monotonic() - started


def measure(gw: Gateway, body: dict[str, Any], count: int, load: Load) -> dict[str, float]:
    send(gw, body, load.concurrency * 2, Load(load.concurrency))  # warm-up: connections, code
    _wait(lambda: _settled(gw) >= 3 * load.concurrency)  # the warm-up's settles are in
    pids = _pids(gw)
    settled0 = _settled(gw)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    msgs0, calls0 = _msgs(gw), _rls_calls(gw)
    elapsed = send(gw, body, count, load)
    _wait(lambda: _settled(gw) >= settled0 + count)  # a batch may still be on its way
    out = {f"{name}_ms": (cpu_seconds(pid) - cpu0[name]) * 1000 / count
           for name, pid in pids.items()}
    out["ext_proc_msgs"] = (_msgs(gw) - msgs0) / count
    out["rls_calls"] = (_rls_calls(gw) - calls0) / count
    out["load1"] = os.getloadavg()[0]
    out["rate"] = count / elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="non-streamed requests")
    parser.add_argument("--streams", type=int, default=60, help="streamed requests")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="pace every workload at this many requests/s (0: closed loop)")
    parser.add_argument("--samples", default="1,0.1,0.02,0",
                        help="telemetry.sample of each run; 1 reads every response, as before")
    parser.add_argument("--settle-batch-ms", default="5",
                        help="LLM_SIDECAR_SETTLE_BATCH_MS of each run (0: Envoy settles)")
    parser.add_argument("--floors", default="5",
                        help="telemetry.sample_min_per_s of each run (0: the share alone)")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                        help=f"which to send, of {','.join(WORKLOADS)}")
    args = parser.parse_args()
    names = args.workloads.split(",")
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {','.join(WORKLOADS)}")
    rows: list[tuple[str, str, dict[str, float]]] = []
    for sample in (float(v) for v in args.samples.split(",")):
        for floor in (int(v) for v in args.floors.split(",")):
            for batch in args.settle_batch_ms.split(","):
                label = f"sample {sample:g}, floor {floor}/s, settle batch {batch} ms"
                env = {"LLM_SIDECAR_SETTLE_BATCH_MS": batch}
                with tempfile.TemporaryDirectory() as work, \
                        running_gateway(_doc(sample, floor), work, env=env) as gw:
                    for name in names:
                        body = WORKLOADS[name]
                        count = args.requests if not body.get("stream") else args.streams
                        rows.append((label, name, measure(gw, body, count,
                                                          Load(args.concurrency, args.rate))))
    print("| run | workload | req/s | extproc ms/req | ratelimit ms/req | Envoy ms/req "
          "| ext_proc msgs/req | RLS calls/req | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, name, r in rows:
        print(f"| {label} | {name} | {r['rate']:.0f} | {r['extproc_ms']:.2f} | "
              f"{r['ratelimit_ms']:.2f} | {r['envoy_ms']:.2f} | {r['ext_proc_msgs']:.1f} | "
              f"{r['rls_calls']:.2f} | {r['load1']:.2f} |")
    for label in dict.fromkeys(label for label, _, _ in rows):
        by = {name: r for lab, name, r in rows if lab == label}
        if not {"json16", "sse256", "sse256+usage"} <= by.keys():
            continue
        print(f"{label}: extproc sse256 / json16 = "
              f"{by['sse256']['extproc_ms'] / by['json16']['extproc_ms']:.2f}, "
              f"sse256+usage / json16 = "
              f"{by['sse256+usage']['extproc_ms'] / by['json16']['extproc_ms']:.2f}")


if __name__ == "__main__":
    main()
