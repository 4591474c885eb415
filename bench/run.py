"""``python -m bench``: every scenario on this machine, then a markdown table and JSON.

Each repeat starts every stack afresh, warms it up, runs each of its workloads at every fixed
offered load (and to saturation for chat), and stops it. Medians are taken over the repeats;
every comparison in the report is between rows of this one invocation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import litellm_proxy, loadgen, machine, report, stack
from bench.measure import Point, measure
from bench.scenarios import STACKS, Scenario, StackName, Workload, request_headers, scenarios, workloads
from sidecar_runtime.process.procs import Child

HERE = Path(__file__).resolve().parent
BEARER = "sk-bench-tenant-key"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--with-litellm", action="store_true",
                   help="also run LiteLLM's proxy (installed into bench/.venv-litellm if missing)")
    p.add_argument("--quick", action="store_true", help="3 s points, one repeat")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per point (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians are reported")
    p.add_argument("--rates", default="50,200,500,1000",
                   help="fixed offered loads for chat, req/s (default 50,200,500,1000)")
    p.add_argument("--paced256-rate", type=int, default=12,
                   help="offered req/s of the 256-token paced streams (default 12: ~90 open, "
                        "~3,000 tokens/s)")
    p.add_argument("--saturation-connections", type=int, default=32)
    p.add_argument("--only", default="", help="comma-separated scenario keys (e.g. bare/chat)")
    p.add_argument("--no-saturation", action="store_true")
    p.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    p.add_argument("--envoy-concurrency", type=int, default=2)
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each point, wait up to this many seconds for the machine to be "
                        "idle (others' CPU is reported either way; 0: never wait)")
    p.add_argument("--out", default=str(HERE / "results"), help="results folder")
    p.add_argument("--no-results-md", action="store_true",
                   help="do not overwrite bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.repeats = 3.0, 1
    return args


@contextmanager
def started(name: StackName, env: stack.Shared, args: argparse.Namespace, tag: str,
            patch: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
            unix_services: bool = False) -> Iterator[tuple[str, dict[str, int], str]]:
    """Start stack ``name``: yields its base URL, its processes' pids and the bearer token
    (``patch``, ``unix_services``: see :func:`bench.stack.gateway`)."""
    spec = STACKS[name]
    if name == "direct":
        yield f"http://127.0.0.1:{env.upstream_port}", {}, BEARER
        return
    if name == "litellm":
        with litellm_proxy.proxy(env) as (url, children):
            yield url, {**_pids(children), "redis": env.pid("redis")}, litellm_proxy.MASTER_KEY
        return
    assert spec.variant is not None
    with stack.gateway(env, spec.variant, spec.store, envoy_concurrency=args.envoy_concurrency,
                       tag=tag, patch=patch, unix_services=unix_services) as gw:
        pids = gw.pids()
        if spec.store == "redis":
            pids["redis"] = env.pid("redis")
        yield gw.url, pids, BEARER


def _pids(children: list[Child]) -> dict[str, int]:
    return {c.name: c.process.pid for c in children}


def run_stack(name: StackName, rows: list[Scenario], loads: dict[str, Workload],
              env: stack.Shared, args: argparse.Namespace, tool: loadgen.Tool, repeat: int,
              probes: dict[str, Any], failures: list[dict[str, Any]]) -> list[Point]:
    """Every point of ``rows`` on stack ``name``; each is also appended to points.jsonl as
    it is measured, so an interrupted run keeps what it measured."""
    points: list[Point] = []
    journal = os.path.join(os.path.dirname(env.workdir), "points.jsonl")
    with started(name, env, args, f"{name}-{repeat}") as (url, pids, bearer):
        others = {c.name: c.process.pid for c in env.children if c.name not in pids}
        for row in rows:
            work = loads[row.workload]
            body_path = os.path.join(env.workdir, f"body-{work.name}.json")
            with open(body_path, "wb") as handle:
                handle.write(work.body)
            headers = request_headers(name, work, bearer)
            status, answer, _ = stack.probe(url + work.path, work.body, dict(headers))
            probes[row.key] = {"status": status, "x-llm-cache": answer.get("x-llm-cache"),
                               "content-type": answer.get("content-type")}
            if status != 200:
                raise RuntimeError(f"{row.key}: probe answered {status}")
            rates: list[int | None] = list(work.rates)
            if work.saturate and not args.no_saturation:
                rates.append(None)
            warm = loadgen.Load(url + work.path, body_path, headers, work.rates[0],
                                min(2.0, args.duration),
                                loadgen.connections_for(work.rates[0], 0, work.latency_s),
                                drain_s=work.latency_s * 2)
            try:
                loadgen.run(tool, warm, env.workdir, "warmup")
            except loadgen.LoadError as exc:
                print(f"bench: {row.key}: warm-up failed ({exc}); measuring anyway", flush=True)
            for rate in rates:
                load = loadgen.Load(url + work.path, body_path, headers, rate, args.duration,
                                    loadgen.connections_for(rate, args.saturation_connections,
                                                            work.latency_s),
                                    drain_s=work.latency_s * 2)
                try:
                    point = measure(tool, load, scenario=row.key, repeat=repeat,
                                    gateway_pids=pids, other_pids=others, workdir=env.workdir,
                                    quiet_s=args.quiet_wait)
                except loadgen.LoadError as exc:
                    failures.append({"scenario": row.key, "repeat": repeat, "rate": rate,
                                     "error": str(exc)[:500]})
                    print(f"bench: {row.key} {rate}: point failed: {exc}", flush=True)
                    continue
                points.append(point)
                with open(journal, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(point.to_json()) + "\n")
                print(f"bench: {row.key:<20} {'sat' if rate is None else rate:>5} "
                      f"{point.achieved_rps:>8.1f} req/s  p50 {point.p50_ms} ms  "
                      f"p99 {point.p99_ms} ms  errors {point.errors}  cpu/req "
                      f"{point.cpu_us_per_request}  foreign {point.foreign_cores}", flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = loadgen.pick_tool(args.loadgen)
    rates = tuple(int(r) for r in args.rates.split(",") if r.strip())
    loads = workloads(rates, args.paced256_rate)
    rows = scenarios(args.with_litellm)
    if args.only:
        wanted = {k.strip() for k in args.only.split(",")}
        rows = [r for r in rows if r.key in wanted]
    litellm_version = litellm_proxy.ensure_installed() if args.with_litellm else None
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out) / stamp
    workdir = out_dir / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    about = machine.describe(tool, litellm_version)
    settings = {k: getattr(args, k) for k in ("duration", "repeats", "rates", "paced256_rate",
                                             "saturation_connections", "envoy_concurrency",
                                             "quiet_wait")}
    print(f"bench: {len(rows)} scenarios, {args.repeats} repeats, load from {tool}; "
          f"results in {out_dir}", flush=True)
    started_at = time.monotonic()
    points: list[Point] = []
    probes: dict[str, Any] = {}
    failures: list[dict[str, Any]] = []
    order: list[StackName] = list(dict.fromkeys(r.stack for r in rows))
    with stack.shared(str(workdir)) as env:
        for repeat in range(args.repeats):
            for name in order:
                points += run_stack(name, [r for r in rows if r.stack == name], loads, env,
                                    args, tool, repeat, probes, failures)
    doc = report.summarize(rows, loads, points, probes, about, settings,
                           time.monotonic() - started_at)
    doc["failed_points"] = failures
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    text = report.markdown(doc)
    (out_dir / "results.md").write_text(text, encoding="utf-8")
    if not args.no_results_md:
        (HERE / "RESULTS.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"bench: wrote {out_dir / 'results.json'} and {out_dir / 'results.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
