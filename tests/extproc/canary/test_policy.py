"""The guard's verdict as a routing input: a value a stream reads once, at its start."""

from __future__ import annotations

from dataclasses import replace

from extproc.actions import Continue
from extproc.canary.guard import CanaryGuards
from extproc.canary.policy import OPEN_CANARIES, CanaryPolicy
from extproc.stream import StreamState
from routing.compiled import Snapshot
from tests.extproc.canary.test_guard import BASE
from tests.extproc.helpers import JSON_POST, snapshot

CANARY = {"model": "v2", "cluster": "vllm-canary", "percent": 100, "guard": {"min_samples": 3}}
MODELS = {"llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": CANARY},
          "bge-m3": {"kind": "embedding", "clusters": ["embed"]}}
CHAT = b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}]}'


def test_policy_table() -> None:
    snap = snapshot(models=MODELS)
    model = snap.models["llama-2-13b"]
    assert model.canary is not None
    unguarded = replace(model, canary=replace(model.canary, guard=None))
    stopped = CanaryPolicy(frozenset({("llama-2-13b", model.canary)}))
    assert OPEN_CANARIES.canary_for(model) is model.canary
    assert stopped.canary_for(model) is None
    # Keyed by the config: a changed canary (another percent) is not the stopped one.
    changed = replace(model, canary=replace(model.canary, percent=10))
    assert stopped.canary_for(changed) is changed.canary
    # A canary without a guard is never stopped; a model without a canary has none.
    assert stopped.canary_for(unguarded) is unguarded.canary
    assert stopped.canary_for(snap.models["bge-m3"]) is None


def trip(guards: CanaryGuards, snap: Snapshot) -> None:
    for _ in range(3):
        guards.observe(snap, BASE)
    for _ in range(3):
        guards.observe(snap, replace(BASE, variant="canary", status=502, errored=True))


def variant(action: object) -> str:
    assert isinstance(action, Continue)
    return dict(action.set_headers)["x-llm-variant"]


def test_a_stream_routes_by_the_policy_in_force_when_it_started() -> None:
    snap = snapshot(models=MODELS)
    guards = CanaryGuards()
    before = guards.policy
    started = StreamState(snap, b"s", guards=guards)
    started.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST},
                   b"", False)
    trip(guards, snap)
    assert guards.policy is not before and guards.tripped()
    assert before == OPEN_CANARIES  # the old value is untouched: a new one is published
    # The stream that started before the trip finishes on the canary it was given ...
    assert variant(started.handle("request_body", None, CHAT, True)) == "canary"
    # ... and every stream after it routes to stable.
    later = StreamState(snap, b"s", guards=guards)
    later.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST},
                 b"", False)
    assert variant(later.handle("request_body", None, CHAT, True)) == "stable"
