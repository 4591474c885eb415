"""Answers are values: once built, nothing (a later stream least of all) can change them."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from extproc.actions import PASS, Continue, ModeOverride, Settlement, evolve
from extproc.records import RequestRecord, RouteChosen
from extproc.stream import routed
from tests.extproc.processors.test_phases import CHAT, started
from tests.extproc.served import Recorder


def test_the_shared_pass_answer_cannot_gain_metadata() -> None:
    with pytest.raises(TypeError):
        PASS.metadata["tokens"] = "5"  # type: ignore[index]
    assert dict(PASS.metadata) == {} and Continue() == PASS


def test_a_dict_given_as_metadata_is_copied_not_shared() -> None:
    given: dict[str, Any] = {"tokens": "5"}
    action = Continue(metadata=given)
    given["done"] = "1"
    assert action.metadata == {"tokens": "5"}
    with pytest.raises(TypeError):
        action.metadata["done"] = "1"  # type: ignore[index]


def test_routing_adds_the_cluster_to_a_copy() -> None:
    action = Continue(set_headers=(("x-llm-cluster", "pool-a"),), metadata={"lease": "l1"})
    out = routed(action)
    assert isinstance(out, Continue)
    assert out.metadata == {"lease": "l1", "cluster": "pool-a"}
    assert action.metadata == {"lease": "l1"}


def test_the_answer_that_ends_a_request_carries_its_record_and_the_service_reports_it() -> None:
    """Processors build records and the stream returns them; the service alone reports them:
    exactly the one the answer carries, once, and a record is no part of the answer's value."""
    telemetry = Recorder()
    state = started("/v1/chat/completions", telemetry)
    state.handle("request_body", None, CHAT, True)
    end = state.handle("response_headers", {":status": "200", "content-type": "application/json"},
                       b"", True)
    assert isinstance(end, Continue) and end.record is not None
    assert telemetry.records == [end.record] and end.record.status == 200
    assert Continue(record=end.record) == PASS
    state.close()
    assert telemetry.records == [end.record]


FULL = Continue(set_headers=(("x-llm-cluster", "vllm-short"),), remove_headers=("x-a",),
                body=b"{}", clear_route_cache=True, mode=ModeOverride(True, "streamed"),
                metadata={"llm_tokens": "5"}, settle=Settlement(((("kind", "tokens"),),)),
                lb_endpoints=("10.0.0.1:8000",),
                route=RouteChosen("m", "c", "stable"),
                record=RequestRecord("r", "m", "c", "stable", "t", 200, False, False, 0.1, None,
                                     None, 1, 2, 3))


@pytest.mark.parametrize("changes", [
    {}, {"settle": None, "metadata": {}}, {"metadata": {"a": 1}, "remove_headers": ("b",)},
    {"body": None, "mode": None, "route": None, "record": None},
])
def test_evolve_is_dataclasses_replace(changes: dict[str, Any]) -> None:
    for action in (PASS, FULL):
        evolved, replaced = evolve(action, **changes), replace(action, **changes)
        assert evolved == replaced
        # route and record are not compared: they must be carried all the same.
        assert (evolved.route, evolved.record) == (replaced.route, replaced.record)
        assert type(evolved.metadata) is MappingProxyType


def test_evolve_leaves_the_original_alone_and_the_copy_read_only() -> None:
    given: dict[str, Any] = {"tokens": "5"}
    action = evolve(FULL, metadata=given)
    given["done"] = "1"
    assert action.metadata == {"tokens": "5"} and FULL.metadata == {"llm_tokens": "5"}
    with pytest.raises(TypeError):
        action.metadata["done"] = "1"  # type: ignore[index]
    with pytest.raises(AttributeError):
        action.body = b""  # type: ignore[misc]


def test_evolve_refuses_a_field_continue_has_not() -> None:
    with pytest.raises(TypeError):
        evolve(PASS, metdata={})
