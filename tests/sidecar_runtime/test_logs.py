"""The JSON log lines every service writes: the fields and values structlog's stdlib-json
renderer wrote, one flushed line per event on stderr, timestamps in the same ISO form."""

from __future__ import annotations

import datetime
import io
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pytest
import structlog

from extproc.records import RequestRecord
from extproc.telemetry.events import NULL_TELEMETRY
from extproc.telemetry.request_log import LoggedTelemetry
from sidecar_runtime.process import logs


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """stderr as the configured services write it; structlog's configuration put back after."""
    config = structlog.get_config()
    bound = structlog.contextvars.get_contextvars()
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    logs.configure("info", "llm-sidecar-extproc")
    yield out
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**bound)


class Colour(Enum):
    RED = 1


@dataclass
class Point:
    x: int


class Logged:
    def __structlog__(self) -> str:
        return "as structlog asks"


EVENTS: dict[str, dict[str, Any]] = {
    "plain": {"event": "e", "s": "text", "i": -7, "b": True, "n": None, "f": 0.547,
              "tiny": 1e-05, "huge": 1e16, "whole": 5.0, "i64": 2**63 - 1},
    "non-ASCII": {"event": "e", "tenant": "café-日本", "quote": "a\"b\\c\n\t\x01"},
    "nested": {"event": "e", "list": [1, "a", None], "dict": {"k": 1, 2: "int key"},
               "tuple": (1, 2)},
    "NaN and infinity": {"event": "e", "nan": math.nan, "inf": -math.inf},
    "past 64 bits": {"event": "e", "big": 2**70, "negative": -2**64},
    "objects json cannot write": {"event": "e", "enum": Colour.RED, "point": Point(1),
                                  "when": datetime.date(2024, 5, 1), "set": {1},
                                  "own": Logged()},
}


@pytest.mark.parametrize("event", EVENTS.values(), ids=EVENTS.keys())
def test_a_line_parses_to_what_stdlib_json_wrote(event: dict[str, Any]) -> None:
    before = structlog.processors.JSONRenderer()(None, "info", dict(event))
    line = logs.render_json(None, "info", dict(event))
    assert "\n" not in line
    if any(isinstance(v, float) and not math.isfinite(v) for v in event.values()):
        assert line == before  # json's NaN is not JSON: written as it was
    else:
        assert json.loads(line) == json.loads(before)
    if not line.isascii() or "\\u" in before:
        assert line == before  # non-ASCII text stays escaped, whatever stderr's encoding


@pytest.mark.parametrize(("ns", "text"), [
    (1_714_564_800_123_456_789, "2024-05-01T12:00:00.123456Z"),
    (1_714_564_800_000_000_000, "2024-05-01T12:00:00Z"),  # a whole second: no fraction
    (1_714_564_800_000_000_999, "2024-05-01T12:00:00Z"),
    (1_714_564_801_000_001_000, "2024-05-01T12:00:01.000001Z"),
])
def test_the_timestamp_is_datetimes_iso_form(ns: int, text: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time_ns", lambda: ns)
    assert logs.add_timestamp(None, "info", {})["timestamp"] == text
    second, micros = divmod(ns // 1000, 1_000_000)
    when = datetime.datetime.fromtimestamp(second, datetime.UTC)
    assert text == when.replace(microsecond=micros).isoformat().replace("+00:00", "Z")


def test_each_finished_request_is_one_line_with_every_field(stderr: io.StringIO) -> None:
    record = RequestRecord("req-1", "llama-2-13b", "vllm-short", "stable", "acme", 200, False,
                           False, 0.0125, None, None, 24, 64, 88)
    telemetry = LoggedTelemetry(NULL_TELEMETRY)
    telemetry.request_done(record)
    telemetry.request_done(record)
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 2 and stderr.getvalue().endswith("\n")
    line = json.loads(lines[0])
    stamp = datetime.datetime.fromisoformat(line.pop("timestamp").replace("Z", "+00:00"))
    assert stamp.tzinfo == datetime.UTC
    assert line == {
        "request_id": "req-1", "model": "llama-2-13b", "cluster": "vllm-short",
        "variant": "stable", "tenant": "acme", "status": 200, "outcome": "ok", "streamed": False,
        "errored": False, "cache": None, "duration_ms": 12.5, "ttft_ms": None,
        "prompt_tokens": 24, "completion_tokens": 64, "charged_tokens": 88, "sampled": True,
        "queued_ms": None, "event": "request_done", "service": "llm-sidecar-extproc", "level": "info"}
    assert list(line) == [*list(line)[:-3], "event", "service", "level"]  # the same order


def test_an_exception_is_rendered_into_its_line(stderr: io.StringIO) -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logs.get_logger("t").exception("failed", where="test")
    (line,) = [json.loads(text) for text in stderr.getvalue().splitlines()]
    assert line["event"] == "failed" and line["level"] == "error"
    assert "RuntimeError: boom" in line["exception"]
