"""``python -m bench.saturation_pairs``: the full gateway's saturation throughput as a share of
bare Envoy's, measured in alternating pairs with both stacks up at once.

``python -m bench`` measures bare Envoy's saturation, stops it, then starts the gateway and
measures its own some 20 s later. On this shared VM the machine's speed drifts by up to 40 %
between those two moments (bare Envoy alone: 7,171 to 10,630 req/s in four runs of one hour),
so one run's share is mostly the drift. Here the bare stack and the ``full-redis`` stack are
started side by side (the idle one costs its timers only), and short saturation points
alternate, bare then gateway, ``--pairs`` times. Each pair's share is the gateway's throughput
over the bare point just before it; the report is their median and spread, and the gateway's
CPU per request by process, against Envoy's own (issue 16's two saturation targets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import loadgen, stack
from bench.measure import Point, measure
from bench.run import HERE, started
from bench.scenarios import StackName, Workload, request_headers, workloads

STACKS: tuple[StackName, ...] = ("bare", "full-redis")


def add_point_arguments(p: argparse.ArgumentParser) -> None:
    """The options of alternating saturation points (what :func:`saturation_load` and
    :func:`bench.run.started` read), shared with ``bench.ab``."""
    p.add_argument("--duration", type=float, default=4.0, help="seconds per point (default 4)")
    p.add_argument("--saturation-connections", type=int, default=32)
    p.add_argument("--envoy-concurrency", type=int, default=2)
    p.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.saturation_pairs", description=__doc__)
    p.add_argument("--pairs", type=int, default=8, help="bare/gateway pairs (default 8)")
    add_point_arguments(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON, not markdown")
    return p.parse_args(argv)


def saturation_load(label: str, name: StackName, end: tuple[str, dict[str, int], str],
                    work: Workload, body_path: str, tool: loadgen.Tool, workdir: Path,
                    args: argparse.Namespace) -> loadgen.Load:
    """Probe stack ``name`` at ``end`` once (a ``RuntimeError`` unless 200), warm it for 2 s at
    200 req/s, and return its closed-loop saturation load (``args.duration`` s,
    ``args.saturation_connections`` connections)."""
    url, _pids, bearer = end
    headers = request_headers(name, work, bearer)
    status, _answer, _ = stack.probe(url + work.path, work.body, dict(headers))
    if status != 200:
        raise RuntimeError(f"{label}: probe answered {status}")
    warm = loadgen.Load(url + work.path, body_path, headers, 200, 2.0,
                        loadgen.connections_for(200, 0, work.latency_s),
                        drain_s=work.latency_s * 2)
    loadgen.run(tool, warm, str(workdir), f"{label}-warmup")
    return loadgen.Load(url + work.path, body_path, headers, None, args.duration,
                        args.saturation_connections, drain_s=work.latency_s * 2)


def summary(points: list[Point]) -> dict[str, Any]:
    """Per pair: the share of bare and (extproc + ratelimit) / Envoy; then their medians."""
    bare = {p.repeat: p for p in points if p.scenario == "bare/chat"}
    full = {p.repeat: p for p in points if p.scenario == "full-redis/chat"}
    pairs: list[dict[str, Any]] = []
    for b, f in ((bare[i], full[i]) for i in sorted(bare.keys() & full.keys())):
        cpu = f.cpu_us_per_request
        envoy = cpu.get("envoy") or 0.0
        pairs.append({
            "bare_rps": b.achieved_rps, "gateway_rps": f.achieved_rps,
            "share": round(f.achieved_rps / b.achieved_rps, 4) if b.achieved_rps else None,
            "cpu_us": cpu,
            "services_vs_envoy": (round((cpu.get("extproc", 0.0) + cpu.get("ratelimit", 0.0))
                                        / envoy, 3) if envoy else None),
            "errors": b.errors + f.errors, "other_cores": max(b.foreign_cores, f.foreign_cores),
        })
    shares = [p["share"] for p in pairs if p["share"] is not None]
    ratios = [p["services_vs_envoy"] for p in pairs if p["services_vs_envoy"] is not None]
    return {
        "pairs": pairs,
        "share_median": round(statistics.median(shares), 4) if shares else None,
        "share_min": min(shares, default=None), "share_max": max(shares, default=None),
        "services_vs_envoy_median": round(statistics.median(ratios), 3) if ratios else None,
        "services_vs_envoy_max": max(ratios, default=None),
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = ["| pair | bare req/s | gateway req/s | share | extproc, ratelimit, Envoy, Redis µs "
             "| (extproc + ratelimit) / Envoy | errors | other |",
             "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(doc["pairs"], 1):
        cpu = p["cpu_us"]
        parts = ", ".join(f"{cpu.get(k, 0):.0f}" for k in ("extproc", "ratelimit", "envoy", "redis"))
        lines.append(f"| {i} | {p['bare_rps']:,.0f} | {p['gateway_rps']:,.0f} | "
                     f"{100 * (p['share'] or 0):.1f} % | {parts} | {p['services_vs_envoy']}x | "
                     f"{p['errors']} | {p['other_cores']:.2f} |")
    lines.append("")
    lines.append(f"share of bare: median **{100 * (doc['share_median'] or 0):.1f} %** "
                 f"(min {100 * (doc['share_min'] or 0):.1f} %, max "
                 f"{100 * (doc['share_max'] or 0):.1f} %; target ≥ 20 %); "
                 f"(extproc + ratelimit) / Envoy: median **{doc['services_vs_envoy_median']}x** "
                 f"(max {doc['services_vs_envoy_max']}x; target ≤ 1.5x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tool = loadgen.pick_tool(args.loadgen)
    work = workloads((200,))["chat"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "saturation-pairs-work"
    workdir.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    body_path = str(workdir / "body-chat.json")
    Path(body_path).write_bytes(work.body)
    with stack.shared(str(workdir)) as env, \
            started("bare", env, args, "pairs-bare") as bare, \
            started("full-redis", env, args, "pairs-full") as full:
        ends: dict[StackName, tuple[str, dict[str, int], str]] = {"bare": bare,
                                                                 "full-redis": full}
        loads = {name: saturation_load(f"{name}/chat", name, end, work, body_path, tool,
                                       workdir, args) for name, end in ends.items()}
        every = {f"{n}:{k}": v for n, (_, pids, _) in ends.items() for k, v in pids.items()}
        every.update({f"shared:{c.name}": c.process.pid for c in env.children})
        for pair in range(args.pairs):
            for name in STACKS:
                pids = ends[name][1]
                # Redis is both the gateway's and shared: a pid of the measured stack is never
                # also an other.
                others = {k: v for k, v in every.items() if v not in pids.values()}
                try:
                    point = measure(tool, loads[name], scenario=f"{name}/chat", repeat=pair,
                                    gateway_pids=pids, other_pids=others,
                                    workdir=str(workdir), quiet_s=0.0)
                except loadgen.LoadError as exc:  # the pair is left out of the summary
                    print(f"bench.saturation_pairs: {pair + 1} {name}: point failed: {exc}",
                          flush=True)
                    continue
                points.append(point)
                print(f"bench.saturation_pairs: {pair + 1}/{args.pairs} {name:<10} "
                      f"{point.achieved_rps:>8.1f} req/s  cpu/req {point.cpu_us_per_request}  "
                      f"errors {point.errors}", flush=True)
    doc = summary(points)
    doc["points"] = [p.to_json() for p in points]
    doc["settings"] = {"pairs": args.pairs, "duration": args.duration,
                       "saturation_connections": args.saturation_connections,
                       "envoy_concurrency": args.envoy_concurrency, "loadgen": str(tool)}
    (out / "saturation-pairs.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(json.dumps({k: v for k, v in doc.items() if k != "points"}) if args.json
          else markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
