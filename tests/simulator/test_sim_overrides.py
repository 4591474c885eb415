"""What ``POST /sim/state`` accepts and refuses (the pure parser)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.dcgm import GPU_IDLE, HW_THERMAL, SW_THERMAL, GpuReading
from simulator.errors import SimError
from simulator.overrides import NONE, SimOverrides, parse_overrides


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, NONE),
        ({"clear": True}, NONE),
        ({"clear": False}, NONE),
        ({"waiting": None, "kv_usage": None}, NONE),  # null: not overridden
        ({"waiting": 40, "kv_usage": 0.99}, SimOverrides(waiting=40, kv_usage=0.99)),
        ({"running": 0, "kv_usage": 1}, SimOverrides(running=0, kv_usage=1.0)),
        ({"throttled": True}, SimOverrides(throttle_reasons=SW_THERMAL | HW_THERMAL)),
        ({"throttled": False}, SimOverrides(throttle_reasons=0)),
        ({"throttle_reasons": 0x80}, SimOverrides(throttle_reasons=0x80)),
        ({"gpu_temp_c": 92, "fb_used_mib": 80000, "fb_free_mib": 1920.5},
         SimOverrides(gpu_temp_c=92.0, fb_used_mib=80000.0, fb_free_mib=1920.5)),
        ({"fail_metrics": True, "fail_dcgm": False}, SimOverrides(fail_metrics=True)),
        ({"fail_requests": True}, SimOverrides(fail_requests=True)),
    ],
)  # fmt: skip
def test_accepted_bodies(body: dict[str, Any], expected: SimOverrides) -> None:
    assert parse_overrides(body) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "must be a JSON object"),
        ("waiting", "must be a JSON object"),
        ({"wating": 3}, "unknown keys: wating"),
        ({"waiting": -1}, "waiting must be a non-negative integer"),
        ({"waiting": 1.5}, "waiting must be a non-negative integer"),
        ({"waiting": True}, "waiting must be a non-negative integer"),
        ({"waiting": "40"}, "waiting must be a non-negative integer"),
        ({"kv_usage": 1.01}, "kv_usage must be between 0 and 1"),
        ({"kv_usage": -0.1}, "kv_usage must be between 0 and 1"),
        ({"kv_usage": "full"}, "kv_usage must be a number"),
        ({"gpu_temp_c": 1e6}, "gpu_temp_c must be between -50 and 200"),
        ({"throttled": 1}, "throttled must be true or false"),
        ({"throttled": True, "throttle_reasons": 64}, "not both"),
        ({"throttle_reasons": 2**64}, "64 bits"),
        ({"fail_metrics": "yes"}, "fail_metrics must be true or false"),
        ({"clear": True, "waiting": 3}, "clear takes no other keys"),
        ({"clear": 1}, "clear must be true or false"),
    ],
)
def test_refused_bodies_are_400(body: object, message: str) -> None:
    with pytest.raises(SimError) as caught:
        parse_overrides(body)
    assert caught.value.status == 400
    assert message in caught.value.message


def test_gpu_overrides_replace_only_what_they_name() -> None:
    real = GpuReading(temp_c=40, fb_used_mib=73728, fb_free_mib=8192, throttle_reasons=GPU_IDLE)
    assert NONE.gpu(real) == real
    hot = parse_overrides({"gpu_temp_c": 92, "throttled": True}).gpu(real)
    assert hot == GpuReading(92, 73728, 8192, SW_THERMAL | HW_THERMAL)


def test_as_json_lists_only_what_is_overridden() -> None:
    assert NONE.as_json() == {}
    assert parse_overrides({"waiting": 0, "fail_metrics": True}).as_json() == {
        "waiting": 0,
        "fail_metrics": True,
    }


def test_the_readme_example_is_accepted() -> None:
    section = (Path(__file__).parents[2] / "docs" / "reference" / "simulator.md").read_text()
    example = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    parsed = parse_overrides(example)
    assert parsed.waiting == 40 and parsed.throttle_reasons == SW_THERMAL | HW_THERMAL
