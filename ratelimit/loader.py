"""Strict loading of envoyproxy/ratelimit descriptor files into a :class:`RateLimitConfig`.

The format is envoyproxy/ratelimit's (``domain``, nested ``descriptors`` with ``key``,
optional ``value`` (``prefix*`` wildcards), ``rate_limit {unit, requests_per_unit, unlimited,
name, replaces}``, ``shadow_mode``, ``detailed_metric``) plus these extensions:

* ``rate_limit.burst``: bucket capacity (default ``requests_per_unit``);
* ``rate_limit.unit: 5m`` (``30s``, ``5m``, ``12h``, ``7d``, ``2w``) or
  ``rate_limit.unit_multiplier: 5`` with a plain unit: a window of several units;
* ``rate_limit.debt: true``: an LLM-token bucket charged after the fact (see ``bucket.py``);
* ``rate_limit.concurrent: N`` (instead of ``unit``/``requests_per_unit``): at most N requests
  in flight, each holding a slot under its lease until the stream-done call releases it;
* top-level ``on_backend_error: allow|deny`` (default ``allow``).

Every problem raises :class:`ConfigError` as ``FILE:LINE: message``. A routing YAML (a file
with a top-level ``version:``) is converted by ``routing.ratelimits.descriptor_document``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path as FsPath
from types import MappingProxyType
from typing import Any, cast

from ratelimit.descriptors import (
    UNIT_SECONDS,
    Branch,
    DomainConfig,
    Limit,
    Node,
    OnBackendError,
    RateLimitConfig,
)
from ratelimit.document import Document, Path, parse_yaml
from ratelimit.errors import ConfigError

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
_UINT32_MAX = 2**32 - 1
_SHORT_UNIT = re.compile(r"^([0-9]+)(s|m|min|h|d|w)$")
_SHORT_UNITS = {"s": "second", "m": "minute", "min": "minute", "h": "hour", "d": "day", "w": "week"}
YAML_SUFFIXES = (".yaml", ".yml")
_UNIT_HINT = " (expected second, minute, hour, day, week, month, year, or a window like 5m)"


def load_path(path: str | FsPath) -> RateLimitConfig:
    """Load a descriptor file, a routing YAML, or a directory of YAML files (one domain each;
    hidden entries such as Kubernetes' ``..data`` are skipped, symlinks are followed)."""
    root = FsPath(path)
    if root.is_dir():
        files = sorted(
            entry
            for entry in root.iterdir()
            if not entry.name.startswith(".") and entry.name.endswith(YAML_SUFFIXES) and entry.is_file()
        )
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError(str(root), 1, "no such file or directory")
    return _merge([_load_file(file) for file in files])


def load_document(
    doc: Mapping[str, Any], source: str, lines: Mapping[Path, int] | None = None
) -> RateLimitConfig:
    """Load one descriptor document given as a dict (e.g. built from a routing YAML).

    ``source`` names it in errors; ``lines`` optionally maps paths such as
    ``("descriptors", 0, "rate_limit", "unit")`` to lines of the file it came from.
    """
    return _merge([compile_domain(Document(source, doc, lines or {}))])


def load_text(text: str, source: str) -> RateLimitConfig:
    """Load one descriptor document from YAML text."""
    return _merge([compile_domain(parse_yaml(text, source))])


def is_routing_yaml(doc: Document) -> bool:
    return isinstance(doc.data, dict) and "version" in doc.data


def _load_file(file: FsPath) -> DomainConfig:
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, 1, f"cannot read: {exc}") from None
    doc = parse_yaml(text, source)
    if is_routing_yaml(doc):
        doc = _from_routing(file)
    return compile_domain(doc)


def _from_routing(file: FsPath) -> Document:
    try:
        # Imported late: the routing package is another team's and optional here.
        ratelimits = importlib.import_module("routing.ratelimits")
    except ImportError:
        raise ConfigError(
            str(file), 1, "routing YAML given, but routing.ratelimits is not available"
        ) from None
    convert = cast(Callable[[str], Any], ratelimits.descriptor_document)
    routing_error = cast(type[Exception], importlib.import_module("routing.errors").ConfigError)
    try:
        result = convert(str(file))
    except routing_error as exc:
        # The routing YAML's own FILE:LINE problems, reported as this package's ConfigError.
        problems = getattr(exc, "problems", [])
        first = problems[0] if problems else None
        line = first.line if first is not None else 1
        message = "; ".join(p.message for p in problems) or str(exc)
        raise ConfigError(str(file), line, message) from None
    if isinstance(result, tuple):
        data, lines = result
        return Document(str(file), data, lines)
    return Document(str(file), result)


def _merge(domains: list[DomainConfig]) -> RateLimitConfig:
    seen: dict[str, DomainConfig] = {}
    for domain in domains:
        first = seen.get(domain.name)
        if first is not None:
            raise ConfigError(
                domain.source,
                domain.line,
                f"duplicate domain '{domain.name}' (first in {first.source}:{first.line})",
            )
        seen[domain.name] = domain
    return RateLimitConfig(MappingProxyType(seen), tuple(domain.source for domain in domains))


def compile_domain(doc: Document) -> DomainConfig:
    """Validate and compile one document (one domain)."""
    data = doc.data
    if data is None:
        raise doc.error((), "empty config: expected 'domain' and 'descriptors'")
    _expect_mapping(doc, (), data, "the document")
    _check_keys(doc, (), data, _ROOT_KEYS)
    domain = data.get("domain")
    if not isinstance(domain, str) or not domain.strip():
        where: Path = ("domain",) if "domain" in data else ()
        raise doc.error(where, "config file cannot have empty domain")
    policy = data.get("on_backend_error", "allow")
    if policy not in ("allow", "deny"):
        raise doc.error(("on_backend_error",), "on_backend_error must be 'allow' or 'deny'")
    root = Node(None, _compile_level(doc, ("descriptors",), data.get("descriptors"), domain))
    policy_value = cast(OnBackendError, policy)
    return DomainConfig(domain, root, policy_value, doc.source, doc.line(("domain",)))


def _compile_level(doc: Document, path: Path, items: Any, parent: str) -> Mapping[str, Branch]:
    if items is None:
        return MappingProxyType({})
    if not isinstance(items, list):
        raise doc.error(path, "descriptors must be a list")
    exact: dict[str, dict[str, Node]] = {}
    wildcards: dict[str, list[tuple[str, Node]]] = {}
    defaults: dict[str, Node] = {}
    first_line: dict[tuple[str, str], int] = {}
    for index, item in enumerate(items):
        here = (*path, index)
        _expect_mapping(doc, here, item, "a descriptor")
        _check_keys(doc, here, item, _DESCRIPTOR_KEYS)
        key = item.get("key")
        if not isinstance(key, str) or not key:
            raise doc.error((*here, "key") if "key" in item else here, "descriptor has empty key")
        value = _value_text(doc, (*here, "value"), item.get("value"))
        composite = f"{key}_{value}" if value else key
        full_key = f"{parent}.{composite}"
        seen = first_line.get((key, value))
        if seen is not None:
            raise doc.error(here, f"duplicate descriptor composite key '{full_key}' (first at line {seen})")
        first_line[(key, value)] = doc.line(here)
        node = Node(
            _compile_limit(doc, here, item, full_key),
            _compile_level(doc, (*here, "descriptors"), item.get("descriptors"), full_key),
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


def _compile_limit(doc: Document, here: Path, item: dict[str, Any], full_key: str) -> Limit | None:
    shadow = _bool(doc, (*here, "shadow_mode"), item.get("shadow_mode", False))
    detailed = _bool(doc, (*here, "detailed_metric"), item.get("detailed_metric", False))
    block = item.get("rate_limit")
    if block is None:
        return None
    at: Path = (*here, "rate_limit")
    _expect_mapping(doc, at, block, "rate_limit")
    _check_keys(doc, at, block, _LIMIT_KEYS)
    name = block.get("name", "")
    if not isinstance(name, str):
        raise doc.error((*at, "name"), "name must be a string")
    replaces = _replaces(doc, (*at, "replaces"), block.get("replaces"), name)
    unlimited = _bool(doc, (*at, "unlimited"), block.get("unlimited", False))
    debt = _bool(doc, (*at, "debt"), block.get("debt", False))
    if unlimited:
        for field in ("unit", "requests_per_unit", "unit_multiplier", "burst", "debt", "concurrent"):
            if field in block:
                raise doc.error((*at, field), f"unlimited rate limit should not specify '{field}'")
        return Limit(
            full_key,
            0,
            "second",
            unlimited=True,
            name=name,
            shadow_mode=shadow,
            detailed_metric=detailed,
            replaces=replaces,
        )
    if "concurrent" in block:
        slots = _uint(doc, (*at, "concurrent"), block["concurrent"], "concurrent")
        if slots < 1:
            raise doc.error((*at, "concurrent"), "concurrent must be a positive integer")
        for field in ("unit", "requests_per_unit", "unit_multiplier", "burst", "debt"):
            if field in block:
                raise doc.error((*at, field), f"a concurrent limit should not specify '{field}'")
        return Limit(full_key, slots, "second", name=name, shadow_mode=shadow,
                     detailed_metric=detailed, replaces=replaces, concurrent=slots)
    unit, multiplier = _unit(doc, at, block)
    if "requests_per_unit" not in block:
        raise doc.error(at, "rate_limit needs requests_per_unit (or unlimited: true)")
    rpu = _uint(doc, (*at, "requests_per_unit"), block["requests_per_unit"], "requests_per_unit")
    burst = None
    if "burst" in block:
        burst = _uint(doc, (*at, "burst"), block["burst"], "burst")
        if burst < 1:
            raise doc.error((*at, "burst"), "burst must be a positive integer")
    return Limit(full_key, rpu, unit, multiplier, burst, name, False, shadow, debt, detailed, replaces)


def _unit(doc: Document, at: Path, block: dict[str, Any]) -> tuple[str, int]:
    if "unit" not in block:
        raise doc.error(at, "rate_limit needs unit (or unlimited: true)")
    raw = block["unit"]
    if not isinstance(raw, str) or not raw.strip():
        raise doc.error((*at, "unit"), f"invalid rate limit unit '{raw}'{_UNIT_HINT}")
    text = raw.strip().lower()
    multiplier = 1
    if text in UNIT_SECONDS:
        unit = text
    else:
        short = _SHORT_UNIT.match(text)
        if short is None or int(short.group(1)) < 1:
            raise doc.error((*at, "unit"), f"invalid rate limit unit '{raw}'{_UNIT_HINT}")
        unit, multiplier = _SHORT_UNITS[short.group(2)], int(short.group(1))
    if "unit_multiplier" in block:
        factor = _uint(doc, (*at, "unit_multiplier"), block["unit_multiplier"], "unit_multiplier")
        if factor < 1:
            raise doc.error((*at, "unit_multiplier"), "unit_multiplier must be a positive integer")
        if multiplier != 1:
            raise doc.error((*at, "unit_multiplier"), f"unit_multiplier cannot be combined with unit '{raw}'")
        multiplier = factor
    return unit, multiplier


def _replaces(doc: Document, at: Path, raw: Any, own: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise doc.error(at, "replaces must be a list of {name: ...}")
    names: list[str] = []
    for index, entry in enumerate(raw):
        here = (*at, index)
        _expect_mapping(doc, here, entry, "a replaces entry")
        _check_keys(doc, here, entry, ("name",))
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise doc.error(here, "should not have an empty replaces entry")
        if name == own:
            raise doc.error(here, "replaces should not contain name of same descriptor")
        names.append(name)
    return tuple(names)


def _value_text(doc: Document, at: Path, raw: Any) -> str:
    if raw is None:
        return ""
    if isinstance(raw, dict | list):
        raise doc.error(at, "value must be a scalar")
    text = doc.raw.get(at)
    if text is not None:
        return text
    if isinstance(raw, bool):
        return "true" if raw else "false"
    return str(raw)


def _bool(doc: Document, at: Path, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise doc.error(at, f"'{at[-1]}' must be true or false")
    return raw


def _uint(doc: Document, at: Path, raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= _UINT32_MAX:
        raise doc.error(at, f"{what} must be an integer from 0 to {_UINT32_MAX}")
    return raw


def _expect_mapping(doc: Document, at: Path, raw: Any, what: str) -> None:
    if not isinstance(raw, dict):
        raise doc.error(at, f"{what} must be a mapping")


def _check_keys(doc: Document, at: Path, raw: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in raw:
        if key not in allowed:
            raise doc.error((*at, key), f"unknown key '{key}' (expected one of: {', '.join(allowed)})")
