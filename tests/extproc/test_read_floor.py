"""``telemetry.sample_min_per_s`` (issue 35): besides the sampled share, extproc reads up to N
responses a second per model, so a quiet gateway is measured in full; and the canary guard
still compares what it compared before the floor."""

from __future__ import annotations

import pathlib
import textwrap
import uuid
from dataclasses import replace
from typing import Any

import orjson
import pytest

from extproc.actions import Continue, ModeOverride
from extproc.canary.guard import CanaryGuards
from extproc.records import RequestRecord
from extproc.sampling import ReadFloor
from extproc.stream import StreamState
from routing.compiled import Snapshot
from routing.errors import ConfigError
from routing.loader import load_config
from tests.extproc.helpers import BASE, JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

NO_BODY = Continue(mode=ModeOverride(response_headers=True, response_body="none"))
SSE = {":status": "200", "content-type": "text/event-stream"}
TOKENS = (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n' * 3
          + b"data: [DONE]\n\n")
MODELS: dict[str, Any] = {
    **BASE["models"], "mistral-7b": {"clusters": ["vllm-short"]}}


@pytest.mark.parametrize(("per_s", "calls", "read"), [
    # (model, monotonic seconds) in order -> whether each is read
    (5, [("a", 10.0), ("a", 10.1), ("a", 10.2), ("a", 10.3), ("a", 10.4), ("a", 10.5)],
     [True] * 5 + [False]),                           # the 6th in a second falls to the share
    (5, [("a", 10.0)] * 5 + [("a", 10.99), ("a", 11.0), ("a", 11.5)],
     [True] * 5 + [False, True, True]),               # the next second refills
    (2, [("a", 3.0), ("a", 3.1), ("b", 3.2), ("b", 3.3), ("a", 3.4), ("b", 3.5)],
     [True, True, True, True, False, False]),         # each model its own
    (1, [("a", 7.9), ("a", 9.2), ("a", 9.3)], [True, True, False]),  # a skipped second
    (0, [("a", 1.0), ("b", 1.0)], [False, False]),    # 0: the share alone
])
def test_the_floor_reads_the_first_n_of_each_second_per_model(
        per_s: int, calls: list[tuple[str, float]], read: list[bool]) -> None:
    floor = ReadFloor()
    assert [floor.take(model, per_s, now) for model, now in calls] == read


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "Input should be greater than or equal to 0"),
    ("2.5", "Input should be a valid integer, got a number with a fractional part"),
])
def test_a_floor_below_0_or_not_whole_is_a_check_error(value: str, message: str,
                                                       tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(textwrap.dedent(f"""\
        version: 1
        clusters:
          vllm-short: {{endpoints: ["10.0.0.11:8000"], max_context: 2048}}
        models:
          llama-2-13b: {{clusters: [vllm-short]}}
        telemetry: {{sample_min_per_s: {value}}}
        """))
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert [str(p) for p in caught.value.problems] == [
        f"{path}:6: telemetry.sample_min_per_s: {message}"]


def stream(snap: Snapshot, floor: ReadFloor | None, now: float, model: str = "llama-2-13b",
           request_id: str = "r-1") -> tuple[Served, Recorder]:
    """One streamed chat routed at ``now`` (monotonic seconds), its response headers seen."""
    records = Recorder()
    state = Served(StreamState(snap, b"secret", clock=lambda: now, read_floor=floor), records)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "x-request-id": request_id}, b"", False)
    state.handle("request_body", None, orjson.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}), True)
    return state, records


def measured(snap: Snapshot, floor: ReadFloor | None, now: float,
             model: str = "llama-2-13b") -> bool:
    """Does this stream end up in the TTFT histogram (its body read, its TTFT known)?"""
    state, records = stream(snap, floor, now, model)
    if state.handle("response_headers", SSE, b"", False) == NO_BODY:
        [record] = records.records
        assert not record.sampled and record.ttft_s is None
        return False
    state.handle("response_body", None, TOKENS, True)
    [record] = records.records
    assert record.sampled and record.ttft_s is not None and record.completion_tokens == 3
    return True


def test_a_quiet_gateway_with_the_default_share_measures_every_stream() -> None:
    snap = snapshot(models=MODELS, telemetry={})  # the defaults: sample 0.01, floor 5/s
    assert snap.config.telemetry.sample == 0.01 and snap.config.telemetry.sample_min_per_s == 5
    floor = ReadFloor()
    # The request ids all fall outside the 1 % share ("r-1"), so only the floor reads them.
    assert [measured(snap, floor, 100 + i / 10) for i in range(6)] == [True] * 5 + [False]
    assert measured(snap, floor, 100.95, "mistral-7b")  # another model: its own five
    assert [measured(snap, floor, 101.0 + i / 10) for i in range(3)] == [True] * 3


def test_a_floor_of_0_reads_only_the_share() -> None:
    snap = snapshot(telemetry={"sample": 0, "sample_min_per_s": 0})
    assert not measured(snap, ReadFloor(), 5.0)


def test_the_floor_is_spent_only_on_streams_nothing_else_reads() -> None:
    """Canary requests are read anyway (and, with a canary, the stable share is the canary's):
    they leave the floor's reads to the stable requests the share did not pick."""
    canary = {"model": "v2", "cluster": "vllm-canary", "percent": 100, "sticky": "request"}
    models = {**MODELS, "llama-2-13b": {**MODELS["llama-2-13b"], "canary": canary}}
    snap = snapshot(models=models, telemetry={"sample": 0, "sample_min_per_s": 1})
    floor = ReadFloor()
    for i in range(3):
        _, records = stream(snap, floor, 7.0, request_id=f"c-{i}")
        assert records.routes[-1].variant == "canary"
    assert floor.take("llama-2-13b", 1, 7.5)  # still this second's one read


def test_a_floor_read_asks_envoy_for_the_body_as_a_sampled_one_does() -> None:
    """Every request's headers ask Envoy for the response body (streamed); at the response
    headers an unread one says none, and a floor read, like a sampled one, lets it come."""
    snap = snapshot(telemetry={"sample": 0})
    bare, _ = stream(snap, None, 1.0)
    floored, _ = stream(snap, ReadFloor(), 1.0)
    assert bare.handle("response_headers", SSE, b"", False) == NO_BODY
    assert floored.handle("response_headers", SSE, b"", False) == Continue()


GUARDED = {"model": "v2", "cluster": "vllm-canary", "percent": 10, "sticky": "request",
           "guard": {"min_samples": 20, "max_error_ratio": 2.0}}


def traffic(snap: Snapshot, seconds: int, per_s: int) -> list[RequestRecord]:
    """``per_s`` streams a second, the last 40 % of each second failing (503) on either
    variant alike: load that builds up inside each second, as a burst does."""
    floor = ReadFloor()
    out: list[RequestRecord] = []
    for second in range(seconds):
        for i in range(per_s):
            now = 1000 + second + i / per_s
            state, records = stream(snap, floor, now,
                                    request_id=str(uuid.UUID(int=second * 7919 + i * 104729)))
            failing = i >= per_s * 0.6
            if failing:
                state.handle("response_headers", {":status": "503"}, b"", True)
            elif state.handle("response_headers", SSE, b"", False) != NO_BODY:
                state.handle("response_body", None, TOKENS, True)
            [record] = records.records
            out.append(record)
    return out


def test_the_floors_reads_do_not_bias_the_canary_guard() -> None:
    """A canary exactly as good as stable is not stopped. The floor reads the first stable
    requests of each second, here all before the failures start; counted by the guard they
    would cut stable's error rate by more than half and stop the canary (the second guard,
    fed them as if the share had picked them, is stopped)."""
    models = {**MODELS, "llama-2-13b": {**MODELS["llama-2-13b"], "canary": GUARDED}}
    snap = snapshot(models=models, telemetry={"sample": 0.01, "sample_min_per_s": 5})
    records = traffic(snap, seconds=30, per_s=30)
    by_floor = [r for r in records if r.by_floor]
    assert len(by_floor) == 30 * 5 and all(r.variant == "stable" and r.sampled
                                           for r in by_floor)
    guards, floor_counted = CanaryGuards(), CanaryGuards()
    for record in records:
        guards.observe(snap, record)
        floor_counted.observe(snap, replace(record, by_floor=False))
    model = snap.models["llama-2-13b"]
    assert guards.effective(model) is model.canary and guards.tripped() == {}
    assert floor_counted.effective(model) is None
    assert "error rate" in floor_counted.tripped()["llama-2-13b"]
