"""Load from a separate process: wrk (C, LuaJIT) when installed, else :mod:`bench.pyload`.

Two shapes of run, both over HTTP/1.1 keep-alive connections:

- fixed offered load: arrivals are due every ``1 / rate`` s on one schedule (open loop: a slow
  answer does not push later arrivals back), each sent on whichever of ``connections`` is
  free; a request is timed from when it is written. Connections are sized so one is nearly
  always free; when none is, the arrival waits, and the achieved rate shows it;
- saturation (``rate`` None): every connection sends its next request as soon as the last one is
  answered, for ``duration_s``.

wrk has no fixed-rate mode of its own: the Lua script below keeps the schedule with a monotonic
clock (LuaJIT FFI) in wrk's ``delay()`` hook. Both tools print one JSON summary line.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Literal

Tool = Literal["wrk", "python"]


@dataclass(frozen=True)
class Load:
    url: str
    body_path: str
    headers: tuple[tuple[str, str], ...]
    rate: int | None
    duration_s: float
    connections: int
    drain_s: float = 0.0
    """Fixed loads: after the ``duration_s`` sending window, how long answers still streaming
    may take. wrk runs that much longer (sending nothing more); pyload waits for every answer
    anyway. Without it wrk would cut the streams open at the end, whose CPU was spent but
    whose requests were not counted: ~90 streams of ~8 s in a 20 s point."""


@dataclass(frozen=True)
class Outcome:
    requests: int
    ok: int
    errors: int
    elapsed_s: float
    percentiles_ms: dict[str, float | None]
    """Keys ``p50``, ``p90``, ``p99``, ``p999``, ``max``."""
    sent_s: float | None = None
    """Fixed loads: the sending window (the drain after it is in ``elapsed_s``, not here)."""
    drain_s: float = 0.0
    """The drain the load allowed (:attr:`Load.drain_s`)."""

    @property
    def rps(self) -> float:
        """Requests per second over the sending window, or over the run less the drain allowed
        when the last answers took longer than that: waiting the expected time for the last
        streams is not a rate missed, a gateway still answering long after is (pyload sends
        every request on schedule, so that is where its overload shows)."""
        window = max(self.sent_s or self.elapsed_s, self.elapsed_s - self.drain_s)
        return self.requests / window if window > 0 else 0.0


def pick_tool(wanted: str) -> Tool:
    if wanted == "python":
        return "python"
    if shutil.which("wrk"):
        return "wrk"
    if wanted == "wrk":
        raise RuntimeError("wrk is not installed: apt-get install -y wrk")
    return "python"


def connections_for(rate: int | None, saturation_connections: int,
                    latency_s: float = 0.01) -> int:
    """Saturation: as given. Fixed loads: enough connections that one is nearly always free
    (twice ``rate`` times the expected ``latency_s``), at least one per 25 req/s, 4 to 256."""
    if rate is None:
        return saturation_connections
    return max(4, min(256, max(rate // 25, math.ceil(rate * latency_s * 2))))


_LUA = r"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local ts = ffi.new("bench_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local file = io.open(BODY_PATH, "rb")
wrk.method = "POST"
wrk.body = file:read("*a")
file:close()
HEADERS

local interval = RATE > 0 and 1000 / RATE or 0
local next_due = nil
local to_send = math.max(1, math.floor(RATE * WINDOW_MS / 1000 + 0.5))

if RATE > 0 then
  function delay()
    local now = now_ms()
    if next_due == nil then next_due = now end
    -- After the sending window (as many requests as pyload sends): send nothing more, let
    -- the open answers finish (the drain).
    if to_send <= 0 then return 3600000 end
    to_send = to_send - 1
    local wait = next_due - now
    next_due = next_due + interval
    if wait <= 0 then return 0 end
    return wait
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  local failed = e.connect + e.read + e.write + e.timeout + e.status
  local p = function(q) return latency:percentile(q) / 1000 end
  io.write(string.format(
    '{"requests": %d, "errors": %d, "elapsed_s": %.6f, "p50": %.3f, "p90": %.3f, ' ..
    '"p99": %.3f, "p999": %.3f, "max": %.3f%s}\n',
    summary.requests, failed, summary.duration / 1e6, p(50), p(90), p(99), p(99.9),
    latency.max / 1000,
    RATE > 0 and string.format(', "sent_s": %.3f', WINDOW_MS / 1000) or ""))
end
"""


def wrk_script(load: Load) -> str:
    headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in load.headers)
    return (_LUA.replace("BODY_PATH", json.dumps(load.body_path))
            .replace("HEADERS", headers)
            .replace("WINDOW_MS", str(round(load.duration_s * 1000)))
            .replace("RATE", str(load.rate or 0)))


def command(tool: Tool, load: Load, workdir: str, tag: str) -> list[str]:
    if tool == "wrk":
        # A tag names a point ("bare/chat-warmup"): one file, not a directory per stack.
        script = os.path.join(workdir, f"load-{tag.replace('/', '-')}.lua")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(wrk_script(load))
        total = load.duration_s + (load.drain_s if load.rate is not None else 0.0)
        return ["wrk", "-t", "1", "-c", str(load.connections), "-d", f"{max(1, round(total))}s",
                "--timeout", "10s", "-s", script, load.url]
    cmd = [sys.executable, "-m", "bench.pyload", "--url", load.url, "--body", load.body_path,
           "--duration", f"{load.duration_s:g}", "--connections", str(load.connections)]
    for name, value in load.headers:
        cmd += ["--header", f"{name}: {value}"]
    if load.rate is not None:
        cmd += ["--rate", str(load.rate)]
    return cmd


class LoadError(RuntimeError):
    """The load generator failed or did not finish in time (the point is reported as failed)."""


def run(tool: Tool, load: Load, workdir: str, tag: str) -> Outcome:
    argv = command(tool, load, workdir, tag)
    limit = load.duration_s * 2 + load.drain_s + 30
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        raise LoadError(f"{argv[0]} did not finish within {limit:.0f} s (it was killed)") from None
    summary = next((line for line in reversed(done.stdout.splitlines())
                    if line.startswith("{")), None)
    if done.returncode != 0 or summary is None:
        raise LoadError(f"{argv[0]} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    doc: dict[str, Any] = json.loads(summary)
    requests, errors = int(doc["requests"]), int(doc["errors"])
    sent, elapsed = doc.get("sent_s"), float(doc["elapsed_s"])
    # wrk runs for a fixed time (window + drain, rounded to whole seconds): a gateway falling
    # behind shows as fewer requests sent, never as a longer run, so all of its tail is drain.
    drain = load.drain_s if tool == "python" else elapsed
    return Outcome(requests, max(0, requests - errors), errors, elapsed,
                   {k: doc.get(k) for k in ("p50", "p90", "p99", "p999", "max")},
                   None if sent is None else float(sent), drain)
