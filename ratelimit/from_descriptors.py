"""One envoyproxy/ratelimit descriptor document (plain data with lines) validated and compiled
into a :class:`DomainConfig`, every problem reported at its own line.

The format and its extensions are described in ``ratelimit.loader``. A problem ends the check of
the part it is in (a descriptor, a ``rate_limit`` block, a field of it) and no more, so one run
names every wrong part of a file, as ``llm-sidecar check`` does for the routing YAML.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ratelimit.descriptors import UNIT_SECONDS, Branch, DomainConfig, Limit, Node, OnBackendError
from ratelimit.errors import ConfigError, Problem
from routing.ratelimits import UINT32_MAX
from routing.yamlsrc import Located, Path

_ROOT_KEYS = ("domain", "descriptors", "on_backend_error")
_DESCRIPTOR_KEYS = ("key", "value", "rate_limit", "descriptors", "shadow_mode", "detailed_metric")
_LIMIT_KEYS = (
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "burst",
    "unit_multiplier",
    "debt",
    "concurrent",
)
_SHORT_UNIT = re.compile(r"^([0-9]+)(s|m|min|h|d|w)$")
_SHORT_UNITS = {"s": "second", "m": "minute", "min": "minute", "h": "hour", "d": "day", "w": "week"}
_UNIT_HINT = " (expected second, minute, hour, day, week, month, year, or a window like 5m)"


class _Invalid(Exception):
    """One problem of a descriptor document; caught where the next independent part starts,
    so every part is checked and every problem reported."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


class _Check:
    """A descriptor document under validation and the problems found so far."""

    def __init__(self, doc: Located) -> None:
        self.doc = doc
        self.problems: list[Problem] = []

    def error(self, path: Path, message: str) -> _Invalid:
        return _Invalid(self.doc.problem(path, message))

    def add(self, path: Path, message: str) -> None:
        self.problems.append(self.doc.problem(path, message))

    @contextmanager
    def part(self) -> Iterator[None]:
        """Record a problem raised inside and carry on after the block."""
        try:
            yield
        except _Invalid as bad:
            self.problems.append(bad.problem)


def compile_domain(doc: Located) -> DomainConfig:
    """Validate and compile one descriptor document (one domain); raises :class:`ConfigError`
    with every problem found, in line order."""
    data = doc.data
    if data is None:
        raise ConfigError([doc.problem((), "empty config: expected 'domain' and 'descriptors'")])
    if not isinstance(data, dict):
        raise ConfigError([doc.problem((), "the document must be a mapping")])
    check = _Check(doc)
    _check_keys(check, (), data, _ROOT_KEYS)
    domain = data.get("domain")
    if not isinstance(domain, str) or not domain.strip():
        check.add(("domain",) if "domain" in data else (), "config file cannot have empty domain")
        domain = ""
    raw_policy = data.get("on_backend_error", "allow")
    if raw_policy not in ("allow", "deny"):
        check.add(("on_backend_error",), "on_backend_error must be 'allow' or 'deny'")
    policy: OnBackendError = "deny" if raw_policy == "deny" else "allow"
    root = Node(None, _compile_level(check, ("descriptors",), data.get("descriptors"), domain))
    if check.problems:
        raise ConfigError(sorted(check.problems, key=lambda p: p.line))
    return DomainConfig(domain, root, policy, doc.source, doc.line_of(("domain",)))


def _compile_level(check: _Check, path: Path, items: Any, parent: str) -> Mapping[str, Branch]:
    if items is None:
        return MappingProxyType({})
    if not isinstance(items, list):
        check.add(path, "descriptors must be a list")
        return MappingProxyType({})
    exact: dict[str, dict[str, Node]] = {}
    wildcards: dict[str, list[tuple[str, Node]]] = {}
    defaults: dict[str, Node] = {}
    first_line: dict[tuple[str, str], int] = {}
    for index, item in enumerate(items):
        here = (*path, index)
        with check.part():
            _expect_mapping(check, here, item, "a descriptor")
            _check_keys(check, here, item, _DESCRIPTOR_KEYS)
            key = item.get("key")
            if not isinstance(key, str) or not key:
                raise check.error((*here, "key") if "key" in item else here,
                                  "descriptor has empty key")
            value = _value_text(check, (*here, "value"), item.get("value"))
            composite = f"{key}_{value}" if value else key
            full_key = f"{parent}.{composite}"
            seen = first_line.get((key, value))
            if seen is not None:
                raise check.error(
                    here, f"duplicate descriptor composite key '{full_key}' (first at line {seen})")
            first_line[(key, value)] = check.doc.line_of(here)
            limit = None
            with check.part():
                limit = _compile_limit(check, here, item, full_key)
            node = Node(
                limit,
                _compile_level(check, (*here, "descriptors"), item.get("descriptors"), full_key),
            )
            if not value:
                defaults[key] = node
            elif value.endswith("*"):
                wildcards.setdefault(key, []).append((value[:-1], node))
            else:
                exact.setdefault(key, {})[value] = node
    keys = set(exact) | set(wildcards) | set(defaults)
    return MappingProxyType(
        {
            key: Branch(
                MappingProxyType(exact.get(key, {})),
                tuple(wildcards.get(key, ())),
                defaults.get(key),
            )
            for key in keys
        }
    )


def _compile_limit(check: _Check, here: Path, item: dict[str, Any], full_key: str) -> Limit | None:
    """The descriptor's limit; None when it has none, or when a problem was recorded."""
    before = len(check.problems)
    shadow = detailed = False
    with check.part():
        shadow = _bool(check, (*here, "shadow_mode"), item.get("shadow_mode", False))
    with check.part():
        detailed = _bool(check, (*here, "detailed_metric"), item.get("detailed_metric", False))
    block = item.get("rate_limit")
    if block is None:
        return None
    at: Path = (*here, "rate_limit")
    _expect_mapping(check, at, block, "rate_limit")
    _check_keys(check, at, block, _LIMIT_KEYS)
    name = block.get("name", "")
    if not isinstance(name, str):
        check.add((*at, "name"), "name must be a string")
        name = ""
    elif not _utf8(name):
        # Every answer of the limit carries its name (Envoy's x-ratelimit headers): one UTF-8
        # cannot carry would fail each of them (upb and protowire refuse to write it).
        check.add((*at, "name"), "name holds a lone surrogate (such as \\ud800), which is not "
                                 "text UTF-8 can carry")
        name = ""
    replaces = _replaces(check, (*at, "replaces"), block.get("replaces"), name)
    unlimited = debt = False
    with check.part():
        unlimited = _bool(check, (*at, "unlimited"), block.get("unlimited", False))
    with check.part():
        debt = _bool(check, (*at, "debt"), block.get("debt", False))
    if unlimited:
        for field in ("unit", "requests_per_unit", "unit_multiplier", "burst", "debt", "concurrent"):
            if field in block:
                check.add((*at, field), f"unlimited rate limit should not specify '{field}'")
        limit: Limit | None = Limit(full_key, 0, "second", unlimited=True, name=name,
                                    shadow_mode=shadow, detailed_metric=detailed,
                                    replaces=replaces)
    elif "concurrent" in block:
        slots = _uint(check, (*at, "concurrent"), block["concurrent"], "concurrent")
        if slots < 1:
            raise check.error((*at, "concurrent"), "concurrent must be a positive integer")
        for field in ("unit", "requests_per_unit", "unit_multiplier", "burst", "debt"):
            if field in block:
                check.add((*at, field), f"a concurrent limit should not specify '{field}'")
        limit = Limit(full_key, slots, "second", name=name, shadow_mode=shadow,
                      detailed_metric=detailed, replaces=replaces, concurrent=slots)
    else:
        rate = _rate(check, at, block)
        limit = None if rate is None else Limit(
            full_key, rate.requests_per_unit, rate.unit, rate.multiplier, rate.burst, name, False,
            shadow, debt, detailed, replaces)
    return limit if len(check.problems) == before else None


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class _Rate:
    requests_per_unit: int
    unit: str
    multiplier: int
    burst: int | None


def _rate(check: _Check, at: Path, block: dict[str, Any]) -> _Rate | None:
    """The rate of a ``rate_limit`` block, or None (the problem recorded). Its unit, amount
    and burst are read in that order and the first problem ends the block: a block with an
    unknown unit and no amount is one mistake to fix, reported once."""
    with check.part():
        unit, multiplier = _unit(check, at, block)
        if "requests_per_unit" not in block:
            raise check.error(at, "rate_limit needs requests_per_unit (or unlimited: true)")
        rpu = _uint(check, (*at, "requests_per_unit"), block["requests_per_unit"],
                    "requests_per_unit")
        burst = None
        if "burst" in block:
            burst = _uint(check, (*at, "burst"), block["burst"], "burst")
            if burst < 1:
                raise check.error((*at, "burst"), "burst must be a positive integer")
        return _Rate(rpu, unit, multiplier, burst)
    return None


def _unit(check: _Check, at: Path, block: dict[str, Any]) -> tuple[str, int]:
    if "unit" not in block:
        raise check.error(at, "rate_limit needs unit (or unlimited: true)")
    raw = block["unit"]
    if not isinstance(raw, str) or not raw.strip():
        raise check.error((*at, "unit"), f"invalid rate limit unit '{raw}'{_UNIT_HINT}")
    text = raw.strip().lower()
    multiplier = 1
    if text in UNIT_SECONDS:
        unit = text
    else:
        short = _SHORT_UNIT.match(text)
        if short is None or int(short.group(1)) < 1:
            raise check.error((*at, "unit"), f"invalid rate limit unit '{raw}'{_UNIT_HINT}")
        unit, multiplier = _SHORT_UNITS[short.group(2)], int(short.group(1))
    if "unit_multiplier" in block:
        factor = _uint(check, (*at, "unit_multiplier"), block["unit_multiplier"], "unit_multiplier")
        if factor < 1:
            raise check.error((*at, "unit_multiplier"), "unit_multiplier must be a positive integer")
        if multiplier != 1:
            raise check.error((*at, "unit_multiplier"),
                              f"unit_multiplier cannot be combined with unit '{raw}'")
        multiplier = factor
    return unit, multiplier


def _replaces(check: _Check, at: Path, raw: Any, own: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        check.add(at, "replaces must be a list of {name: ...}")
        return ()
    names: list[str] = []
    for index, entry in enumerate(raw):
        here = (*at, index)
        with check.part():
            _expect_mapping(check, here, entry, "a replaces entry")
            _check_keys(check, here, entry, ("name",))
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise check.error(here, "should not have an empty replaces entry")
            if name == own:
                raise check.error(here, "replaces should not contain name of same descriptor")
            names.append(name)
    return tuple(names)


def _value_text(check: _Check, at: Path, raw: Any) -> str:
    if raw is None:
        return ""
    if isinstance(raw, dict | list):
        raise check.error(at, "value must be a scalar")
    text = check.doc.raw.get(at)
    if text is not None:
        return text
    if isinstance(raw, bool):
        return "true" if raw else "false"
    return str(raw)


def _bool(check: _Check, at: Path, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise check.error(at, f"'{at[-1]}' must be true or false")
    return raw


def _uint(check: _Check, at: Path, raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= UINT32_MAX:
        raise check.error(at, f"{what} must be an integer from 0 to {UINT32_MAX}")
    return raw


def _expect_mapping(check: _Check, at: Path, raw: Any, what: str) -> None:
    if not isinstance(raw, dict):
        raise check.error(at, f"{what} must be a mapping")


def _check_keys(check: _Check, at: Path, raw: dict[Any, Any], allowed: tuple[str, ...]) -> None:
    """Every key not in ``allowed`` is a problem of its own; the rest is still checked."""
    for key in raw:
        if key not in allowed:
            check.add((*at, key), f"unknown key '{key}' (expected one of: {', '.join(allowed)})")
