"""Medians over repeats, comparisons between rows of the same run, targets, and the markdown."""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable
from typing import Any

from bench.measure import Point
from bench.scenarios import STACKS, Scenario, Workload

OVERLOADED = 0.95
"""A fixed-load point whose achieved rate is below this share of the offered one is overloaded."""
PROCS = ("envoy", "extproc", "ratelimit", "redis", "litellm")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _rate_key(rate: int | None) -> str:
    return "sat" if rate is None else str(rate)


def _cell(points: list[Point]) -> dict[str, Any]:
    def med(get: Callable[[Point], float | None]) -> float | None:
        return _median([get(p) for p in points])

    def cpu_of(name: str) -> Callable[[Point], float | None]:
        return lambda p: p.cpu_us_per_request.get(name)

    cpu = {name: med(cpu_of(name))
           for name in PROCS if any(name in p.cpu_us_per_request for p in points)}
    return {
        "repeats": len(points), "achieved_rps": med(lambda p: p.achieved_rps),
        "p50_ms": med(lambda p: p.p50_ms), "p90_ms": med(lambda p: p.p90_ms),
        "p99_ms": med(lambda p: p.p99_ms), "p999_ms": med(lambda p: p.p999_ms),
        "errors": sum(p.errors for p in points), "requests": sum(p.requests for p in points),
        "cpu_us_per_request": cpu, "gateway_cores": med(lambda p: p.gateway_cores),
        "foreign_cores": med(lambda p: p.foreign_cores),
        "loadgen_cores": med(lambda p: p.loadgen_cores),
    }


def _per_token(entry: dict[str, Any], bare: dict[str, Any] | None) -> None:
    """For a streamed workload: each cell's total CPU per request, per process and in total
    per streamed token, and the total as a multiple of bare Envoy's at the same rate."""
    tokens = entry["tokens"]
    if not tokens:
        return
    for key, cell in entry["rates"].items():
        cpu = {k: v for k, v in cell["cpu_us_per_request"].items() if v is not None}
        cell["cpu_us_total"] = round(sum(cpu.values()), 1)
        cell["cpu_us_per_token"] = {k: round(v / tokens, 3) for k, v in cpu.items()}
        other = bare["rates"].get(key) if bare else None
        base = other.get("cpu_us_total") if other else None
        cell["cpu_vs_bare_envoy"] = round(cell["cpu_us_total"] / base, 2) if base else None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def summarize(rows: list[Scenario], loads: dict[str, Workload], points: list[Point],
              probes: dict[str, Any], about: dict[str, Any], settings: dict[str, Any],
              wall_s: float) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for row in rows:
        cells: dict[str, Any] = {}
        for rate in dict.fromkeys(p.rate for p in points if p.scenario == row.key):
            mine = [p for p in points if p.scenario == row.key and p.rate == rate]
            cell = _cell(mine)
            cell["overloaded"] = rate is not None and (cell["achieved_rps"] or 0) < OVERLOADED * rate
            cells[_rate_key(rate)] = cell
        table[row.key] = {"stack": STACKS[row.stack].title, "workload": loads[row.workload].title,
                          "baseline": row.baseline, "rates": cells,
                          "tokens": loads[row.workload].tokens}
    for row in rows:
        _per_token(table[row.key], table.get(f"bare/{row.workload}"))
    for entry in table.values():
        base = table.get(entry["baseline"] or "")
        for key, cell in entry["rates"].items():
            other = base["rates"].get(key) if base else None
            if other is not None and key != "sat":
                cell["added_p50_ms"] = _sub(cell["p50_ms"], other["p50_ms"])
                cell["added_p99_ms"] = _sub(cell["p99_ms"], other["p99_ms"])
            if cell.get("gateway_cores"):
                cell["rps_per_core"] = round((cell["achieved_rps"] or 0) / cell["gateway_cores"], 1)
    doc = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": about, "settings": settings, "wall_s": round(wall_s, 1), "probes": probes,
        "scenarios": table, "points": [p.to_json() for p in points],
    }
    doc["targets"] = targets(table)
    return doc


def _get(table: dict[str, Any], key: str, rate: str) -> dict[str, Any] | None:
    entry = table.get(key)
    cell: dict[str, Any] | None = entry["rates"].get(rate) if entry else None
    return cell


def _target(name: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"target": name, "measured": measured,
            "met": "not measured" if met is None else ("yes" if met else "no")}


def targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    full = _get(table, "full-redis/chat", "500")
    added = full.get("added_p99_ms") if full else None
    out.append(_target("added P99 over bare Envoy at 500 req/s, extproc (buffered body) + "
                       "ratelimit (Redis) ≤ 5 ms",
                       "n/a" if added is None else f"{added:.2f} ms", None if added is None
                       else added <= 5.0))
    out += _litellm_targets(table)
    cpu = full["cpu_us_per_request"] if full else {}
    both = (cpu.get("extproc") or 0) + (cpu.get("ratelimit") or 0) if cpu else None
    out.append(_target("extproc + ratelimit CPU per chat request ≤ 300 µs (at 500 req/s)",
                       "n/a" if both is None else
                       f"{both:.0f} µs (extproc {cpu.get('extproc')}, ratelimit "
                       f"{cpu.get('ratelimit')})", None if both is None else both <= 300))
    big = _get(table, "full-redis/p220", "20")
    p50, p99 = (big.get("added_p50_ms"), big.get("added_p99_ms")) if big else (None, None)
    out.append(_target("a 220 KB prompt adds ≤ 10 ms (P50 at 20 req/s; P99 shown)",
                       "n/a" if p50 is None else f"P50 +{p50:.2f} ms, P99 +{p99} ms",
                       None if p50 is None else p50 <= 10.0))
    return out


def _litellm_targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    lite = table.get("litellm/chat")
    ours = table.get("full-redis/chat")
    name_lat = "added P50/P99 ≤ 1/5 of LiteLLM proxy's (same traffic)"
    name_tp = "throughput per core ≥ 3x LiteLLM's (saturation, req/s per busy gateway core)"
    if lite is None or ours is None:
        why = "litellm/chat or full-redis/chat not run (LiteLLM needs --with-litellm)"
        return [_target(name_lat, why, None), _target(name_tp, why, None)]
    fixed = [k for k in lite["rates"] if k != "sat" and k in ours["rates"]]
    fitting = [k for k in fixed if not lite["rates"][k]["overloaded"]]
    rate = max(fitting, key=int) if fitting else min(fixed, key=int)
    mine, theirs = ours["rates"][rate], lite["rates"][rate]
    ok = None
    measured = "n/a"
    if None not in (mine.get("added_p50_ms"), theirs.get("added_p50_ms"),
                    mine.get("added_p99_ms"), theirs.get("added_p99_ms")):
        ok = (mine["added_p50_ms"] * 5 <= theirs["added_p50_ms"]
              and mine["added_p99_ms"] * 5 <= theirs["added_p99_ms"])
        measured = (f"at {rate} req/s: ours +{mine['added_p50_ms']:.2f}/+{mine['added_p99_ms']:.2f}"
                    f" ms over bare Envoy; LiteLLM +{theirs['added_p50_ms']:.2f}/"
                    f"+{theirs['added_p99_ms']:.2f} ms over no proxy"
                    + (" (LiteLLM overloaded there)" if theirs["overloaded"] else ""))
    out = [_target(name_lat, measured, ok)]
    a, b = ours["rates"].get("sat"), lite["rates"].get("sat")
    if a and b and a.get("rps_per_core") and b.get("rps_per_core"):
        ratio = a["rps_per_core"] / b["rps_per_core"]
        out.append(_target(name_tp, f"{a['rps_per_core']} vs {b['rps_per_core']} req/s per core: "
                           f"{ratio:.1f}x", ratio >= 3))
    else:
        out.append(_target(name_tp, "n/a", None))
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def markdown(doc: dict[str, Any]) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = [
        "# Benchmark results",
        "",
        f"Generated {doc['generated']} by `python -m bench` in {doc['wall_s']:.0f} s "
        f"(commit {m['commit']}).",
        "",
        f"**Machine:** {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux "
        f"{m['kernel']}, Python {m['python']}, Envoy {m['envoy']}, grpcio {m['grpcio']}, "
        f"uvloop {m['uvloop']}, LiteLLM {m['litellm']}. Load: {m['loadgen']}. CPU yardstick: "
        f"{m.get('python_loop_10m_cpu_s')} s for a 10 M-iteration Python loop (about 0.4 s on an "
        f"idle desktop core). "
        f"Everything (load generator, Envoy x2, extproc, ratelimit, Redis, LiteLLM) shares "
        f"these cores.",
        "",
        f"**Settings:** {s['duration']} s per point, median of {s['repeats']} repeats, front "
        f"Envoy --concurrency {s['envoy_concurrency']}, saturation with "
        f"{s['saturation_connections']} connections.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {t['target']} | {t['measured']} | {t['met']} |" for t in doc["targets"]],
        "",
        "## Latency at fixed offered loads",
        "",
        "Latency in ms from request sent to response complete; *added* is over the row named "
        "in *vs*. CPU in µs per request from `/proc/<pid>/stat`. *other* is CPU cores the rest "
        "of the machine used during the point (not ours): high values mean a noisy run. "
        "A rate in *italics* could not be sustained (achieved < 95 % of offered).",
        "",
        "| scenario | vs | req/s | achieved | p50 | p99 | p99.9 | added p50 | added p99 | "
        "extproc µs | ratelimit µs | envoy µs | redis µs | errors | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in doc["scenarios"].items():
        for rate, c in entry["rates"].items():
            if rate == "sat":
                continue
            cpu = c["cpu_us_per_request"]
            shown = f"*{rate}*" if c["overloaded"] else rate
            lines.append(
                f"| {key} | {entry['baseline'] or ''} | {shown} | {_fmt(c['achieved_rps'], 0)} | "
                f"{_fmt(c['p50_ms'])} | {_fmt(c['p99_ms'])} | {_fmt(c['p999_ms'])} | "
                f"{_signed(c.get('added_p50_ms'))} | {_signed(c.get('added_p99_ms'))} | "
                f"{_fmt(cpu.get('extproc'), 0)} | {_fmt(cpu.get('ratelimit'), 0)} | "
                f"{_fmt(cpu.get('envoy') or cpu.get('litellm'), 0)} | {_fmt(cpu.get('redis'), 0)} | "
                f"{c['errors']} | {_fmt(c['foreign_cores'])} |")
    lines += [
        "",
        "## Saturation (chat)",
        "",
        "Closed loop: every connection sends its next request when the last is answered. "
        "*gateway cores* is the CPU the gateway's processes used (Envoy, extproc, ratelimit, "
        "Redis; or LiteLLM and Redis); *per core* divides throughput by it.",
        "",
        "| scenario | req/s | p50 | p99 | gateway cores | req/s per core | µs CPU per request | "
        "errors | other |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in doc["scenarios"].items():
        c = entry["rates"].get("sat")
        if c is None:
            continue
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in c["cpu_us_per_request"].items() if v is not None)
        lines.append(f"| {key} | {_fmt(c['achieved_rps'], 0)} | {_fmt(c['p50_ms'])} | "
                     f"{_fmt(c['p99_ms'])} | {_fmt(c['gateway_cores'])} | "
                     f"{_fmt(c.get('rps_per_core'), 0)} | {cpu or '-'} | {c['errors']} | "
                     f"{_fmt(c['foreign_cores'])} |")
    lines += _streamed(doc["scenarios"])
    failed = doc.get("failed_points") or []
    if failed:
        lines += ["", f"**Failed points** (left out of the medians): {len(failed)}: "
                  + "; ".join(f"{f['scenario']} at {f['rate'] or 'saturation'} (repeat "
                              f"{f['repeat']})" for f in failed)]
    lines += ["", "## Scenarios", ""]
    for key, entry in doc["scenarios"].items():
        probe = doc["probes"].get(key, {})
        cache = f", x-llm-cache: {probe['x-llm-cache']}" if probe.get("x-llm-cache") else ""
        lines.append(f"- `{key}`: {entry['stack']}; {entry['workload']}{cache}")
    return "\n".join(lines) + "\n"


def _streamed(scenarios: dict[str, Any]) -> list[str]:
    """The CPU per request and per token of streamed workloads, bare Envoy's row first."""
    rows = [(key, entry) for key, entry in scenarios.items() if entry.get("tokens")]
    if not rows:
        return []
    lines = [
        "",
        "## Streamed answers: CPU per request and per token",
        "",
        "Tokens arrive one SSE event at a time from the paced server. Each process cell is µs "
        "of CPU per request / per streamed token (per request divided by the tokens of one "
        "answer); *streams* is achieved req/s times P50 latency (streams open at once); "
        "*x bare* is the total over bare Envoy's total at the same rate.",
        "",
        "| scenario | req/s | streams | tokens/s | envoy | extproc | ratelimit | litellm | "
        "redis | total µs/req | µs/token | x bare | errors | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in rows:
        tokens = entry["tokens"]
        for rate, c in entry["rates"].items():
            if rate == "sat":
                continue
            cpu, per = c["cpu_us_per_request"], c["cpu_us_per_token"]
            rps = c["achieved_rps"] or 0.0
            streams = rps * (c["p50_ms"] or 0.0) / 1000
            cells = " | ".join("-" if cpu.get(name) is None
                               else f"{cpu[name]:.0f} / {per[name]:.2f}"
                               for name in ("envoy", "extproc", "ratelimit", "litellm", "redis"))
            lines.append(
                f"| {key} | {_fmt(rps, 1)} | {streams:.0f} | {rps * tokens:,.0f} | "
                f"{cells} | {_fmt(c['cpu_us_total'], 0)} | "
                f"{c['cpu_us_total'] / tokens:.2f} | {_fmt(c['cpu_vs_bare_envoy'])} | "
                f"{c['errors']} | {_fmt(c['foreign_cores'])} |")
    return lines
