"""Answers are values: once built, nothing (a later stream least of all) can change them."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.actions import PASS, Continue
from extproc.stream import routed


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
