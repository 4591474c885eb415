"""extproc.quick_init: the faster ``__init__`` builds the value the dataclass's own would."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest

from extproc import actions, bodies, context, decide, identity, records, usage
from extproc.processors import phases
from extproc.quick_init import quick_init


def _twins() -> tuple[type[Any], type[Any]]:
    """The same frozen dataclass twice: with the dataclass's ``__init__``, and quick."""
    made = []
    for quick in (False, True):
        @dataclass(frozen=True)
        class Value:
            a: int
            b: str = "b"
            c: tuple[int, ...] = field(default_factory=lambda: (1,))
            d: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
            e: int = field(default=5, init=False)
            f: list[int] = field(default_factory=list, init=False)
            g: float = field(default=0.5, compare=False)

            def __post_init__(self) -> None:
                object.__setattr__(self, "d", MappingProxyType(dict(self.d, seen=1)))

        made.append(quick_init(Value) if quick else Value)
    return made[0], made[1]


@pytest.mark.parametrize(("args", "kwargs"), [
    ((1,), {}),
    ((1, "x", (2,), {"k": 3}), {}),
    ((), {"a": 1, "g": 2.5, "c": ()}),
    ((7,), {"d": MappingProxyType({"z": 0})}),
])
def test_quick_init_builds_what_the_dataclass_builds(args: tuple[Any, ...],
                                                     kwargs: dict[str, Any]) -> None:
    slow, quick = _twins()
    want, got = slow(*args, **kwargs), quick(*args, **kwargs)
    assert got.__dict__ == want.__dict__
    assert repr(got).split("(", 1)[1] == repr(want).split("(", 1)[1]
    assert inspect.signature(quick) == inspect.signature(slow)
    # A fresh default from each factory call, as the dataclass makes it.
    assert quick(1).d is not quick(1).d and quick(1).f is not quick(1).f


def test_quick_init_keeps_the_dataclass_frozen_and_its_errors() -> None:
    slow, quick = _twins()
    value = quick(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.a = 2
    assert hash(identity.Identity("k", "t", None)) == hash(identity.Identity("k", "t", None))
    assert dataclasses.replace(value, b="y") == quick(1, "y")
    calls: list[Callable[[Any], object]] = [
        lambda cls: cls(), lambda cls: cls(1, a=2), lambda cls: cls(1, e=3),
        lambda cls: cls(1, nope=1), lambda cls: cls(1, "b", (), {}, 1.0, 2)]
    for call in calls:
        with pytest.raises(TypeError) as want:
            call(slow)
        with pytest.raises(TypeError) as got:
            call(quick)
        assert str(got.value) == str(want.value)


def test_quick_init_refuses_what_it_does_not_handle() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class Slots:
        a: int

    @dataclass(frozen=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclass(frozen=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int]

    clashing = dataclasses.make_dataclass("Clashing", [("__quick_dict", int)], frozen=True)

    class Plain:
        pass

    for cls in (Mutable, Slots, KeywordOnly, WithInitVar, clashing, Plain):
        with pytest.raises(TypeError):
            quick_init(cls)


QUICK = [actions.ModeOverride, actions.CacheWrite, actions.Settlement, actions.Continue,
         actions.Reply, actions.Lookup, actions.LimitStatus, actions.Verdict, actions.RateCheck,
         records.RequestRecord, usage.Usage, decide.Demand, decide.Decision, identity.Identity,
         bodies.PromptParts, bodies.GenerationBody, context.RequestContext, phases.Routed,
         phases.Reading]


@pytest.mark.parametrize("cls", QUICK, ids=lambda cls: cls.__name__)
def test_extprocs_values_take_their_fields_as_before(cls: type[Any]) -> None:
    """The signature is the fields in order, each with its own default (a factory's stands
    in as a sentinel): what the dataclass's own ``__init__`` takes."""
    assert "__setattr__" not in cls.__init__.__code__.co_names  # the quick one is in place
    params = list(inspect.signature(cls).parameters.values())
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert [p.name for p in params] == [f.name for f in fields]
    for param, spec in zip(params, fields, strict=True):
        if spec.default is not dataclasses.MISSING:
            assert param.default is spec.default
        elif spec.default_factory is dataclasses.MISSING:
            assert param.default is inspect.Parameter.empty


def test_continue_still_freezes_its_metadata() -> None:
    given = {"a": 1}
    step = actions.Continue(metadata=given)
    given["a"] = 2
    assert step.metadata == {"a": 1} and isinstance(step.metadata, MappingProxyType)
    assert actions.Continue() == actions.PASS and actions.Continue().metadata == {}
