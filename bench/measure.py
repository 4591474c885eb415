"""One measured point: load from a separate process, CPU of every process before and after.

Besides latency and throughput, a point records the CPU seconds each gateway process used per
request (``/proc/<pid>/stat``), the load generator's own CPU, and the *foreign* CPU: what the
rest of the machine used meanwhile (busy time from ``/proc/stat`` minus ours), so a reader can
see when a run shared the machine with something else.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import acct, loadgen


def _busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_quiet(max_wait_s: float, busy_cores: float = 0.3) -> float:
    """Until the machine's busy CPU over 0.5 s is below ``busy_cores`` (our idle stack
    included), at most ``max_wait_s``; the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s:
        before = _busy_seconds()
        time.sleep(0.5)
        if (_busy_seconds() - before) / 0.5 < busy_cores:
            break
    return time.monotonic() - started


@dataclass
class Point:
    scenario: str
    repeat: int
    rate: int | None
    """Offered req/s; None for saturation."""
    connections: int
    requests: int
    ok: int
    errors: int
    elapsed_s: float
    achieved_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)
    """Per gateway process (envoy, extproc, ratelimit, redis, litellm), µs per request."""
    gateway_cores: float = 0.0
    """CPU cores the gateway's processes used on average during the run."""
    loadgen_cores: float = 0.0
    foreign_cores: float = 0.0
    quiet_wait_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure(tool: loadgen.Tool, load: loadgen.Load, *, scenario: str, repeat: int,
            gateway_pids: dict[str, int], other_pids: dict[str, int], workdir: str,
            quiet_s: float) -> Point:
    waited = wait_quiet(quiet_s) if quiet_s > 0 else 0.0
    every = {**gateway_pids, **other_pids}
    cpu_before = acct.snapshot(every)
    busy_before, children_before = _busy_seconds(), _children_cpu()
    outcome = loadgen.run(tool, load, workdir, scenario.replace("/", "-"))
    busy = _busy_seconds() - busy_before
    loadgen_cpu = _children_cpu() - children_before
    used = acct.delta(cpu_before, acct.snapshot(every))
    elapsed = max(outcome.elapsed_s, 1e-9)
    requests = max(outcome.requests, 1)
    gateway = {name: used[name] for name in gateway_pids}
    return Point(
        scenario=scenario, repeat=repeat, rate=load.rate, connections=load.connections,
        requests=outcome.requests, ok=outcome.ok, errors=outcome.errors,
        elapsed_s=round(outcome.elapsed_s, 3), achieved_rps=round(outcome.rps, 1),
        p50_ms=outcome.percentiles_ms["p50"], p90_ms=outcome.percentiles_ms["p90"],
        p99_ms=outcome.percentiles_ms["p99"], p999_ms=outcome.percentiles_ms["p999"],
        max_ms=outcome.percentiles_ms["max"],
        cpu_us_per_request={k: round(v / requests * 1e6, 1) for k, v in gateway.items()},
        gateway_cores=round(sum(gateway.values()) / elapsed, 3),
        loadgen_cores=round(loadgen_cpu / elapsed, 3),
        foreign_cores=round(max(0.0, busy - sum(used.values()) - loadgen_cpu) / elapsed, 3),
        quiet_wait_s=round(waited, 1),
    )
