"""``python -m bench.flow_control`` cannot rot: its script, how it judges an answer, its figures,
its routing document, and a tiny run of every mode.

Nothing here is about whether flow control meets issue 37's bar: the tiny run (far below any
capacity figure worth the name) checks that the three runs start, every request is answered and
the tables and the bar are printed.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from bench.flow_control import (
    KEYS,
    PRIORITY,
    TIER,
    WORKLOAD,
    Outcome,
    Run,
    plan,
    routing_doc,
)
from bench.picker_load import Pod
from sidecar_runtime.process.procs import envoy_binary
from tests.harness.ci import unavailable

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_is_the_same_for_the_same_seed_and_arrives_at_the_rate() -> None:
    first = plan(WORKLOAD, rate=20.0, duration_s=60.0, seed=1)
    assert first == plan(WORKLOAD, rate=20.0, duration_s=60.0, seed=1)
    assert first != plan(WORKLOAD, rate=20.0, duration_s=60.0, seed=2)
    assert 1000 < len(first) < 1400  # about 20/s for 60 s
    assert all(a.at < 60.0 for a in first)
    assert [a.at for a in first] == sorted(a.at for a in first)
    quiet = sum(1 for a in first if a.tenant == "quiet")
    assert 0.06 < quiet / len(first) < 0.12  # one in eleven


def test_the_tiers_fall_on_either_side_of_the_priority_thresholds() -> None:
    arrivals = plan(WORKLOAD, rate=20.0, duration_s=30.0, seed=3)
    for tenant in ("loud", "quiet"):
        mine = [a.request for a in arrivals if a.tenant == tenant]
        high = [r for r in mine if TIER[r.kind] == "high"]
        assert 0.15 < len(high) / len(mine) < 0.45  # about 30% high for each tenant
    for req in (a.request for a in arrivals):
        weight = req.prompt_tokens * req.max_tokens / 1000
        if TIER[req.kind] == "high":
            assert weight < PRIORITY["high_below"]
        else:
            assert weight >= PRIORITY["low_from"]


def _outcome(status: int, retry_after: bool = False, *, tenant: str = "loud", tier: str = "high",
             ended: float = 1.0, ttft: float | None = 0.1, queued_s: float | None = None,
             tokens: int = 10) -> Outcome:
    return Outcome(cast(Any, tenant), tier, status, retry_after, ended, ttft, tokens, queued_s)


@pytest.mark.parametrize(("status", "retry_after", "verdict"), [
    (200, False, "completed"),
    (503, True, "refused"),
    (429, True, "refused"),
    (503, False, "lost"),  # an overload without retry-after leaves the client guessing
    (429, False, "lost"),
    (500, True, "lost"),
    (599, False, "lost"),  # no answer, a cut stream, a timeout
])
def test_only_a_whole_stream_or_a_503_429_with_retry_after_is_not_lost(
        status: int, retry_after: bool, verdict: str) -> None:
    assert _outcome(status, retry_after).verdict == verdict


def test_the_figures_count_what_the_clients_saw() -> None:
    outcomes = [_outcome(200, ttft=0.1, tokens=20),
                _outcome(200, tier="low", ttft=0.3, queued_s=0.2, tokens=100),
                _outcome(200, tenant="quiet", tier="low", ttft=0.5, queued_s=0.4, ended=3.0),
                _outcome(503, True, tenant="quiet", ttft=None, queued_s=2.0),
                _outcome(599, ttft=None)]
    figures = Run("flow", outcomes, 2.0, 1.0).figures()
    assert (figures["completed"], figures["refused"], figures["lost"]) == (3, 1, 1)
    assert figures["req/s"] == 1.0  # the quiet one ended after the window
    assert figures["tok/s"] == 60.0
    assert figures["high P99"] == pytest.approx(0.1)
    assert figures["low P50"] == pytest.approx(0.3)
    assert figures["quiet P99"] == pytest.approx(0.5)
    assert figures["quiet held P99"] == pytest.approx(0.4)  # completed ones only
    assert figures["queued"] == 3
    assert figures["quiet refused"] == 1
    assert math.isnan(Run("flow", [], 2.0, 0.0).figures()["high P50"])


def test_the_routing_document_names_both_tenants_keys_and_the_flow_control() -> None:
    pods = [Pod(f"pod{i}", 1.0, f"http://127.0.0.1:{9000 + i}", cast(Any, None)) for i in range(2)]
    flow = routing_doc(pods, {"max_wait": "1s"})
    assert flow["clusters"]["pool"]["endpoint_picker"] == {"flow_control": {"max_wait": "1s"}}
    assert flow["clusters"]["pool"]["endpoints"] == ["127.0.0.1:9000", "127.0.0.1:9001"]
    assert flow["priority"] == PRIORITY
    assert {(k["tenant"], k["sha256"]) for k in flow["api_keys"]} == {
        (tenant, hashlib.sha256(key.encode()).hexdigest()) for tenant, key in KEYS.items()}
    assert routing_doc(pods, None)["clusters"]["pool"]["endpoint_picker"] == {}


@pytest.mark.e2e
def test_a_tiny_run_of_every_mode_answers_every_request() -> None:
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    done = subprocess.run(
        [sys.executable, "-m", "bench.flow_control", "--decode-ms", "5/10", "--repeats", "1",
         "--duration", "8", "--capacity", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout  # 8 s at 4.8/s with seed 37: 41 requests, 5 of them the quiet tenant's
    assert done.returncode in (0, 1), out[-3000:] + done.stderr[-3000:]  # 1: a bar not met
    for mode in ("noflow", "flow", "alone"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {mode} |"))
        completed, refused, lost = row.split(" | ")[1:4]
        assert int(completed) > 0 and (refused, lost) == ("0", "0"), row
    assert "Issue 37's bar:" in out and "requests lost with flow control 0 == 0" in out, out
