from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from extproc.canary.guard import CanaryGuards, Window, canary_error, verdict
from extproc.records import RequestRecord
from routing.schema import GuardSpec
from tests.extproc.helpers import snapshot

SPEC = GuardSpec(min_samples=10, max_error_ratio=2.0, max_ttft_p99_ratio=2.0)
BASE = RequestRecord("r", "llama-2-13b", "vllm-short", "stable", "default", 200, True, False,
                     0.1, 0.01, 0.001, 10, 10, 20)


def window(n: int, errors: int = 0, ttft: float = 0.01) -> Window:
    w = Window()
    for i in range(n):
        w.add(replace(BASE, errored=i < errors, ttft_s=ttft))
    return w


@pytest.mark.parametrize(("stable", "canary", "tripped"), [
    (window(10), window(9, errors=9), False),              # not enough canary samples
    (window(10), window(10), False),
    (window(10), window(10, errors=1), True),              # 10% > 2 x max(0, 1%)
    (window(100, errors=10), window(100, errors=15), False),  # 15% < 2 x 10%
    (window(100, errors=10), window(100, errors=21), True),
    (window(10, ttft=0.1), window(10, ttft=0.19), False),
    (window(10, ttft=0.1), window(10, ttft=0.21), True),
])
def test_verdicts(stable: Window, canary: Window, tripped: bool) -> None:
    assert (verdict(SPEC, stable, canary) is not None) == tripped


@pytest.mark.parametrize(("status", "errored", "limited", "counts"), [
    (200, False, False, False),
    (200, True, False, True),    # an error event in a 200 stream: the pool failed mid-stream
    (500, True, False, True),    # vLLM's own 5xx
    (503, True, False, True),    # Envoy: pool unreachable, or reset before answering
    (504, True, False, True),    # Envoy: the pool timed out
    (400, True, False, False),   # vLLM refusing a bad request: the client's doing
    (413, True, False, False),
    (429, True, True, False),    # the gateway's rate limiter
    (429, True, False, False),   # a 429 from anywhere: never the canary's fault
    (503, True, True, False),    # the rate limiter's store is down
])
def test_only_pool_failures_count_against_the_canary(status: int, errored: bool, limited: bool,
                                                     counts: bool) -> None:
    record = replace(BASE, status=status, errored=errored, limited=limited)
    assert canary_error(record) is counts


def test_a_client_flooding_the_canary_with_429s_cannot_trip_it() -> None:
    canary = {"model": "v2", "cluster": "vllm-canary", "percent": 50,
              "guard": {"min_samples": 3}}
    snap = snapshot(models={"llama-2-13b": {"clusters": ["vllm-short", "vllm-long"],
                                            "canary": canary},
                            "bge-m3": {"kind": "embedding", "clusters": ["embed"]}})
    guards = CanaryGuards()
    for _ in range(3):
        guards.observe(snap, BASE)
    for _ in range(50):
        assert guards.observe(snap, replace(BASE, variant="canary", status=429, errored=True,
                                            limited=True)) is None
        assert guards.observe(snap, replace(BASE, variant="canary", status=400,
                                            errored=True)) is None
    assert guards.effective(snap.models["llama-2-13b"]) is not None
    # Real pool failures still count: the 3rd 502 among 100 canary samples is 2.9% > 2 x 1%.
    reasons = [guards.observe(snap, replace(BASE, variant="canary", status=502, errored=True))
               for _ in range(3)]
    assert reasons[:2] == [None] * 2 and reasons[2] is not None and "error rate" in reasons[2]


def test_guard_stops_the_canary_until_its_config_changes() -> None:
    canary = {"model": "v2", "cluster": "vllm-canary", "percent": 50,
              "guard": {"min_samples": 3, "max_ttft_p99_ratio": 2.0}}
    models: dict[str, dict[str, Any]] = {
        "llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": canary},
        "bge-m3": {"kind": "embedding", "clusters": ["embed"]}}
    snap = snapshot(models=models)
    guards = CanaryGuards()
    model = snap.models["llama-2-13b"]
    assert guards.effective(model) is model.canary
    for _ in range(3):
        guards.observe(snap, replace(BASE, ttft_s=0.01))
    reasons = [guards.observe(snap, replace(BASE, variant="canary", ttft_s=0.5)) for _ in range(3)]
    assert reasons[:2] == [None, None] and reasons[2] is not None and "TTFT" in reasons[2]
    assert guards.effective(model) is None
    assert "llama-2-13b" in guards.tripped()
    # An unrelated reload (same canary config) keeps the verdict; a changed canary resets it.
    assert guards.effective(snapshot(models=models).models["llama-2-13b"]) is None
    changed = {**models, "llama-2-13b": {**models["llama-2-13b"],
                                         "canary": {**canary, "percent": 10}}}
    fresh = snapshot(models=changed)
    guards.observe(fresh, BASE)
    assert guards.effective(fresh.models["llama-2-13b"]) is not None


def test_workers_share_a_trip_and_a_restarted_one_starts_with_it(tmp_path: Path) -> None:
    """``--workers``: each worker guards from its own share of the traffic; a trip in one stops
    the canary in the others at their next sync, and in a worker started later, as long as
    the canary's config is the one that tripped."""
    canary = {"model": "v2", "cluster": "vllm-canary", "percent": 50,
              "guard": {"min_samples": 3}}
    models: dict[str, dict[str, Any]] = {
        "llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": canary},
        "bge-m3": {"kind": "embedding", "clusters": ["embed"]}}
    snap = snapshot(models=models)
    model = snap.models["llama-2-13b"]
    shared = str(tmp_path / "canary-trips")
    first, second = CanaryGuards(shared), CanaryGuards(shared)
    assert second.sync(snap) == []  # nothing tripped yet (the folder does not even exist)
    for _ in range(3):
        first.observe(snap, BASE)
    reasons = [first.observe(snap, replace(BASE, variant="canary", status=502, errored=True))
               for _ in range(3)]
    assert reasons[-1] is not None and first.effective(model) is None
    assert second.effective(model) is model.canary  # until it syncs
    assert second.sync(snap) == ["llama-2-13b"]
    assert second.effective(model) is None and second.tripped() == {"llama-2-13b": reasons[-1]}
    assert second.sync(snap) == []  # once
    restarted = CanaryGuards(shared)
    assert restarted.sync(snap) == ["llama-2-13b"] and restarted.effective(model) is None
    # A changed canary is another one: the old verdict does not stop it.
    changed = snapshot(models={**models, "llama-2-13b": {**models["llama-2-13b"],
                                                         "canary": {**canary, "percent": 10}}})
    assert CanaryGuards(shared).sync(changed) == []
    assert CanaryGuards().sync(snap) == []  # a single process shares nothing
    # A worker that serves the changed config forgets the old verdict for all of them, as a
    # single process does: the old config, back later, starts afresh.
    second.observe(changed, BASE)
    assert CanaryGuards(shared).sync(snap) == []
