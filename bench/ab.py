"""``python -m bench.ab PATCH[,PATCH...]``: the rendered ``full-redis`` gateway (A) against the
same gateway with its front bootstrap patched (B), both up at once, in alternating saturation
points (A then B, then B then A, ...), so the machine's drift between moments falls on both.

A one-off change to Envoy's side is measured here before it is built; bench/JOURNAL.md
("Saturation in alternating pairs") says why alternation is needed on this machine. Each round's
B / A throughput ratio is reported, then their median and each side's median CPU per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import front, loadgen, stack
from bench.measure import Point, measure
from bench.run import started
from bench.saturation_pairs import add_point_arguments, saturation_load
from bench.scenarios import workloads

Patch = Callable[[dict[str, Any], dict[str, Any]], None]
LUA = "envoy.filters.http.lua"
SSE = "envoy.filters.http.sse_to_metadata"


def _filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    filters: list[dict[str, Any]] = front._hcm(bootstrap)["http_filters"]
    return filters


def _grpc_services(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``grpc_service`` of the ext_proc filter and of the rate-limit filter."""
    found = []
    for f in _filters(bootstrap):
        config = f.get("typed_config", {})
        service = config.get("grpc_service") or config.get("rate_limit_service", {}).get(
            "grpc_service")
        if service is not None:
            found.append(service)
    return found


def google_grpc(bootstrap: dict[str, Any], routing: dict[str, Any]) -> None:
    """Envoy's Google gRPC client (its own threads) instead of its own ``envoy_grpc``."""
    address = {"llm-sidecar-extproc": routing["services"]["extproc"],
               "llm-sidecar-ratelimit": routing["services"]["ratelimit"]}
    for service in _grpc_services(bootstrap):
        cluster = service.pop("envoy_grpc")["cluster_name"]
        service.pop("retry_policy", None)  # an envoy_grpc setting
        service["google_grpc"] = {"target_uri": address[cluster], "stat_prefix": cluster}


def no_retry(bootstrap: dict[str, Any], _routing: dict[str, Any]) -> None:
    """No retry policy on the two gRPC services (reconnecting to a restarted one is lost)."""
    for service in _grpc_services(bootstrap):
        service.pop("retry_policy", None)


def no_access_log(bootstrap: dict[str, Any], _routing: dict[str, Any]) -> None:
    front._hcm(bootstrap).pop("access_log", None)


def _without(name: str) -> Patch:
    def patch(bootstrap: dict[str, Any], _routing: dict[str, Any]) -> None:
        _filters(bootstrap)[:] = [f for f in _filters(bootstrap) if f["name"] != name]
    return patch


PATCHES: dict[str, Patch] = {
    "google_grpc": google_grpc,
    "no_retry": no_retry,
    "no_access_log": no_access_log,
    "no_lua": _without(LUA),
    "no_sse": _without(SSE),
}


UNIX = "unix"
"""Not a bootstrap patch: B's extproc and ratelimit listen on Unix sockets (render's
``unix:/path`` services, a sidecar in Envoy's pod) instead of TCP ports."""


def combined(names: str) -> Patch:
    """The patches named (comma-separated), applied in order; a ``ValueError`` names unknown
    ones. (``unix`` is read by :func:`wants_unix`, and patches nothing here.)"""
    chosen = [n.strip() for n in names.split(",") if n.strip() and n.strip() != UNIX]
    unknown = [n for n in chosen if n not in PATCHES]
    if unknown or not (chosen or wants_unix(names)):
        raise ValueError(f"unknown patch {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join([*PATCHES, UNIX])}")

    def patch(bootstrap: dict[str, Any], routing: dict[str, Any]) -> None:
        for name in chosen:
            PATCHES[name](bootstrap, routing)
    return patch


def wants_unix(names: str) -> bool:
    return UNIX in (n.strip() for n in names.split(","))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    p.add_argument("patches", help=f"comma-separated, of: {', '.join([*PATCHES, UNIX])}")
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds (default 6)")
    add_point_arguments(p)
    return p.parse_args(argv)


def summary(points: list[Point]) -> dict[str, Any]:
    a = {p.repeat: p for p in points if p.scenario == "A"}
    b = {p.repeat: p for p in points if p.scenario == "B"}
    rounds = [{"a_rps": a[r].achieved_rps, "b_rps": b[r].achieved_rps,
               "ratio": round(b[r].achieved_rps / a[r].achieved_rps, 4)}
              for r in sorted(a.keys() & b.keys()) if a[r].achieved_rps]
    ratios = [r["ratio"] for r in rounds]

    def cpu(side: dict[int, Point]) -> dict[str, float]:
        keys = {k for p in side.values() for k in p.cpu_us_per_request}
        return {k: round(statistics.median(p.cpu_us_per_request.get(k, 0.0)
                                           for p in side.values()), 1) for k in sorted(keys)}

    return {"rounds": rounds,
            "ratio_median": round(statistics.median(ratios), 4) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "cpu_us_a": cpu(a), "cpu_us_b": cpu(b)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        patch = combined(args.patches)
    except ValueError as exc:
        print(f"bench.ab: {exc}", file=sys.stderr)
        return 2
    tool = loadgen.pick_tool(args.loadgen)
    work = workloads((200,))["chat"]
    out = Path(args.out)
    workdir = out / "ab-work"
    workdir.mkdir(parents=True, exist_ok=True)
    body_path = str(workdir / "body-chat.json")
    Path(body_path).write_bytes(work.body)
    points: list[Point] = []
    with stack.shared(str(workdir)) as env, \
            started("full-redis", env, args, "ab-a") as a, \
            started("full-redis", env, args, "ab-b", patch=patch,
                    unix_services=wants_unix(args.patches)) as b:
        loads = {side: (saturation_load(side, "full-redis", end, work, body_path, tool, workdir,
                                        args), end[1])
                 for side, end in (("A", a), ("B", b))}
        every = {f"{s}:{k}": v for s, (_, pids) in loads.items() for k, v in pids.items()}
        every.update({f"shared:{c.name}": c.process.pid for c in env.children})
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                load, pids = loads[side]
                others = {k: v for k, v in every.items() if v not in pids.values()}
                point = measure(tool, load, scenario=side, repeat=r, gateway_pids=pids,
                                other_pids=others, workdir=str(workdir), quiet_s=0.0)
                points.append(point)
                print(f"bench.ab: {r + 1}/{args.rounds} {side} {point.achieved_rps:>8.1f} "
                      f"req/s  cpu/req {point.cpu_us_per_request}  errors {point.errors}",
                      flush=True)
    doc = summary(points)
    doc["patches"] = args.patches
    (out / "ab.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
