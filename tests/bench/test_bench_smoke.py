"""The benchmark harness runs end to end (tiny: one scenario, one second, Python load).

Nothing here is about speed: it checks that ``python -m bench`` starts the stack, sends load,
accounts CPU and writes its JSON and markdown, so the harness cannot rot between real runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar_runtime.process.procs import envoy_binary
from tests.harness.ci import unavailable

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def run_with_envoy(*args: str) -> str:
    """``python -m ARGS`` from the repository's root, which starts Envoy: its stdout, once it
    exited 0."""
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_bench_runs_one_tiny_scenario(tmp_path: Path) -> None:
    run_with_envoy("bench", "--only", "full-memory/chat", "--rates", "20", "--duration", "1",
                   "--repeats", "1", "--no-saturation", "--loadgen", "python",
                   "--quiet-wait", "0", "--no-results-md", "--out", str(tmp_path))
    [results] = list(tmp_path.glob("*/results.json"))
    doc = json.loads(results.read_text(encoding="utf-8"))
    cell = doc["scenarios"]["full-memory/chat"]["rates"]["20"]
    assert cell["requests"] > 0
    assert cell["errors"] == 0
    assert set(cell["cpu_us_per_request"]) == {"envoy", "extproc", "ratelimit"}
    assert "| full-memory/chat |" in (results.parent / "results.md").read_text(encoding="utf-8")


def test_reservation_bench_runs_and_counts_redis_work() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.reservations", "--requests", "40",
                           "--concurrency", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| Redis |")]
    assert [row[2].strip() for row in rows] == [
        "requests only", "check, then charge (before)", "reserve, then settle (after)",
        "reserve, settle + concurrency caps"]
    # One EVALSHA per RLS call: admission, then the stream-done settle.
    assert [float(row[4]) for row in rows] == [1.0, 2.0, 2.0, 2.0]


def test_ratelimit_python_bench_times_every_stage_of_a_six_bucket_admission() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.ratelimit_python", "--calls", "20",
                           "--rounds", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("one admission: 6 descriptors, 6 buckets; one settlement batch: 60 descriptors, "
            "60 settles") in done.stdout
    stages = [line.split("|")[1].strip() for line in done.stdout.splitlines()
              if line.startswith("| ") and not line.startswith("| stage")]
    assert stages == ["parse (upb)", "request_from_proto", "request_from_bytes",
                      "plan, matched afresh", "plan, remembered matches", "resolve",
                      "response_to_proto + serialise", "response_bytes",
                      "whole call, instant store", "settlement batch: request_from_proto",
                      "settlement batch: request_from_bytes", "settlement batch: plan",
                      "settlement batch: whole call"]


def test_extproc_python_bench_times_a_chat_request_and_a_settlement_batch() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.extproc_python", "--requests", "100",
                           "--rounds", "1", "--batch", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a batch of 5 requests: 15 descriptors" in done.stdout
    # 100 requests of 3 descriptors: the batcher took their settlements and sent them.
    encoded = re.search(r"; (\d+) settlement batches encoded on the way;", done.stdout)
    assert encoded is not None and int(encoded[1]) >= 2
    stages = [line.split("|")[1].strip() for line in done.stdout.splitlines()
              if line.startswith("| ") and not line.startswith("| stage")]
    assert stages == ["chat request, 4 messages", "settlement batch of 5"]


def test_lua_bench_measures_both_scripts_and_settles_every_marker() -> None:
    old = ROOT / "tests" / "integration" / "lua_before_issue16.py"
    for scripts in ([], ["--scripts", str(old)]):  # this tree's scripts, then the frozen old ones
        done = subprocess.run([sys.executable, "-m", "bench.lua_redis", "--requests", "30", *scripts],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert re.fullmatch(r"DECIDE [\d.]+ µs/call, SETTLE [\d.]+ µs/call, "
                            r"Redis µs/request [\d.]+ \(30 requests\)\n", done.stdout)


def test_saturation_pairs_alternate_bare_and_gateway_and_summarise_each_pair(
        tmp_path: Path) -> None:
    out = run_with_envoy("bench.saturation_pairs", "--pairs", "2", "--duration", "1",
                         "--saturation-connections", "4", "--loadgen", "python", "--json",
                         "--out", str(tmp_path))
    summary = json.loads(out.splitlines()[-1])
    assert len(summary["pairs"]) == 2
    for pair in summary["pairs"]:
        assert pair["bare_rps"] > 0 and pair["gateway_rps"] > 0
        assert pair["errors"] == 0
        assert set(pair["cpu_us"]) == {"envoy", "extproc", "ratelimit", "redis"}
        assert pair["share"] == round(pair["gateway_rps"] / pair["bare_rps"], 4)
    assert summary["share_min"] <= summary["share_median"] <= summary["share_max"]
    doc = json.loads((tmp_path / "saturation-pairs.json").read_text(encoding="utf-8"))
    assert [p["scenario"] for p in doc["points"]] == ["bare/chat", "full-redis/chat"] * 2


def test_stream_cost_paces_every_workload_at_the_given_rate() -> None:
    # No read floor: the default 5/s would read most of these six streams.
    out = run_with_envoy("bench.stream_cost", "--samples", "0", "--floors", "0",
                         "--requests", "10", "--streams", "6", "--concurrency", "4",
                         "--rate", "20")
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith("| sample 0, ")]
    assert [row[2].strip() for row in rows] == ["json16", "sse256", "sse256+usage"]
    for row in rows:
        # Paced: never faster than asked (the first request goes at once, so a little above).
        assert 0 < float(row[3]) <= 25
        assert float(row[7]) == (4.0 if row[2].strip() == "json16" else 3.0)
