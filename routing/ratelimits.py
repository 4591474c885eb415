"""The routing YAML's ``rate_limits:`` as envoyproxy/ratelimit descriptors and Envoy route actions.

One descriptor tree per kind (``kind=requests``, ``kind=tokens``, ``kind=concurrent``), one
branch per level (``api_key``, ``tenant``, ``model``) keyed by the ``x-llm-*`` header extproc
sets (docs: Rate limits):

* admission (when the request starts, after extproc): every requests bucket is charged 1, every
  token bucket the request's reservation (``hits_addend`` from extproc's dynamic metadata
  ``llm_reservation``), every concurrency cap one slot, all or nothing. Token and concurrency
  descriptors carry the request's lease (``llm_lease``, a random id extproc makes) as a control
  entry, so the ratelimit service remembers the reservation and the slot under it.
* stream done (Envoy's ``apply_on_stream_done``, which also runs when the client hung up or the
  upstream reset): the token descriptors carry the tokens the response used (``llm_tokens``,
  set only when the usage is known: by extproc, or by Envoy's sse_to_metadata
  filter) and ``llm_done`` (set with it when the response reached its end), and
  the service settles the reservation once; when either is absent Envoy sends no token
  descriptor and the reservation stands. The
  concurrency descriptors release the lease's slot.
* settled by extproc: for a response extproc read to its end it sends these same token
  descriptors itself, many requests' in one call (:mod:`extproc.settlements`), and sets neither
  ``llm_tokens`` nor ``llm_done``, so Envoy's stream-done call carries only the slot releases
  (and is not made at all when the route has no concurrency cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from routing.compiled import listed_key_id
from routing.schema import LevelLimits, Limit, RoutingConfig
from routing.units import parse_rate
from sidecar_runtime.wire.names import (
    CAP_ENTRY,
    CAP_METADATA_KEY,
    DONE_ENTRY,
    DONE_METADATA_KEY,
    KEY_ID_HEADER,
    LEASE_ENTRY,
    LEASE_METADATA_KEY,
    METADATA_NAMESPACE,
    MODEL_HEADER,
    RELEASE_ENTRY,
    RESERVATION_METADATA_KEY,
    TENANT_HEADER,
    TOKENS_METADATA_KEY,
    USED_ENTRY,
)

KINDS = ("requests", "tokens", "concurrent")

DOMAIN = "llm-sidecar"
LEVEL_HEADERS = {"api_key": KEY_ID_HEADER, "tenant": TENANT_HEADER, "model": MODEL_HEADER}
_UNITS = (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
UINT32_MAX = 2**32 - 1
"""Largest amount a limit may hold: Envoy's RateLimitResponse carries it as a uint32."""


@dataclass(frozen=True)
class LimitEntry:
    """One limit of the descriptor tree: ``kind=KIND`` → ``LEVEL[=VALUE]`` → this limit.

    What both the ratelimit service (``ratelimit.from_routing.compile_rate_limits``) and the
    rendered ``ratelimit.yaml`` (:func:`descriptors`) are made from, so the two cannot differ.
    """

    kind: str
    """``requests``, ``tokens`` or ``concurrent``."""
    level: str
    """``api_key``, ``tenant`` or ``model``."""
    value: str | None
    """The level's value (a key id, tenant or model), or None for the level's default."""
    name: str
    """``LEVEL:NAME:KIND``, e.g. ``api_key:bot:requests``."""
    amount: int
    """Per window; for ``concurrent``, the slots."""
    unit: str = "second"
    unit_multiplier: int = 1
    burst: int | None = None
    shadow: bool = False


def _window(window_s: int) -> tuple[str, int]:
    """The largest unit that divides the window, with a multiplier for ``N/5m``-style rates."""
    for unit, seconds in _UNITS:
        if window_s % seconds == 0:
            return unit, window_s // seconds
    raise AssertionError(window_s)


def _merged(default: Limit | None, override: Limit) -> Limit:
    """An override replaces what it sets; unset fields come from the level's default.

    ``burst`` belongs to the requests rate: a new requests rate without a burst gets the default
    burst of that rate (its N), not the old rate's burst.
    """
    if default is None:
        return override
    requests = override.requests or default.requests
    burst = override.burst if override.requests else (override.burst or default.burst)
    return Limit(requests=requests, burst=burst, tokens=override.tokens or default.tokens,
                 concurrent=override.concurrent or default.concurrent,
                 shadow=override.shadow if override.shadow is not None else default.shadow)


def _level_entries(config: RoutingConfig, level: str,
                   section: LevelLimits) -> list[tuple[str | None, str, Limit]]:
    """(descriptor value or None for "each value", label, limit) for one level."""
    ids = {k.name: listed_key_id(k.sha256) for k in config.api_keys}
    entries: list[tuple[str | None, str, Limit]] = []
    if section.default is not None:
        entries.append((None, f"{level}:default", section.default))
    for name, override in section.overrides.items():
        value = ids[name] if level == "api_key" else name
        entries.append((value, f"{level}:{name}", _merged(section.default, override)))
    return entries


def _rate_entry(kind: str, level: str, value: str | None, label: str, rate_text: str,
                shadow: bool, burst: int | None = None) -> LimitEntry:
    rate = parse_rate(rate_text)
    unit, multiplier = _window(rate.window_s)
    return LimitEntry(kind, level, value, f"{label}:{kind}", rate.amount, unit, multiplier,
                      burst, shadow)


def limit_entries(config: RoutingConfig) -> tuple[LimitEntry, ...]:
    """Every limit of the routing YAML, by kind (``KINDS`` order), then level, default first."""
    limits = config.rate_limits
    kinds: dict[str, list[LimitEntry]] = {kind: [] for kind in KINDS}
    if limits is None:
        return ()
    for level in LEVEL_HEADERS:
        section: LevelLimits | None = getattr(limits, level)
        if section is None:
            continue
        for value, label, limit in _level_entries(config, level, section):
            shadow = bool(limit.shadow)
            if limit.requests:
                kinds["requests"].append(_rate_entry("requests", level, value, label,
                                                     limit.requests, shadow, limit.burst))
            if limit.tokens:
                kinds["tokens"].append(_rate_entry("tokens", level, value, label, limit.tokens,
                                                   shadow))
            if limit.concurrent:
                kinds["concurrent"].append(LimitEntry("concurrent", level, value,
                                                      f"{label}:concurrent", limit.concurrent,
                                                      shadow=shadow))
    return tuple(entry for kind in KINDS for entry in kinds[kind])


def _descriptor(entry: LimitEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"key": entry.level}
    if entry.value is not None:
        out["value"] = entry.value
    if entry.shadow:
        out["shadow_mode"] = True
    if entry.kind == "concurrent":
        out["rate_limit"] = {"name": entry.name, "concurrent": entry.amount}
        return out
    rate: dict[str, Any] = {"name": entry.name, "requests_per_unit": entry.amount,
                            "unit": entry.unit}
    if entry.unit_multiplier != 1:
        rate["unit_multiplier"] = entry.unit_multiplier
    if entry.burst is not None:
        rate["burst"] = entry.burst
    out["rate_limit"] = rate
    return out


def descriptors(config: RoutingConfig) -> dict[str, Any]:
    """What ``llm-sidecar render`` writes to ``ratelimit.yaml``: :func:`limit_entries` as an
    envoyproxy/ratelimit descriptor document."""
    entries = limit_entries(config)
    doc: dict[str, Any] = {"domain": DOMAIN, "descriptors": []}
    if config.rate_limits is not None:
        doc["on_backend_error"] = config.rate_limits.on_backend_error
    for kind in KINDS:
        of_kind = [_descriptor(e) for e in entries if e.kind == kind]
        if of_kind:
            doc["descriptors"].append({"key": "kind", "value": kind, "descriptors": of_kind})
    return doc


def _levels_with(config: RoutingConfig, field: str) -> list[str]:
    limits = config.rate_limits
    if limits is None:
        return []
    out = []
    for level in LEVEL_HEADERS:
        section: LevelLimits | None = getattr(limits, level)
        if section is None:
            continue
        candidates = [section.default, *section.overrides.values()]
        if any(c is not None and getattr(c, field) for c in candidates):
            out.append(level)
    return out


def _actions(kind: str, level: str, *extra: dict[str, Any],
             gate: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``kind``, the level's header, ``extra``; ``gate`` (a required control entry) first:
    Envoy stops at the first action that yields nothing, so a request the gate's metadata is
    absent from costs one lookup."""
    return [
        *([gate] if gate is not None else []),
        {"generic_key": {"descriptor_key": "kind", "descriptor_value": kind}},
        {"request_headers": {"header_name": LEVEL_HEADERS[level], "descriptor_key": level}},
        *extra,
    ]


def _from_metadata(descriptor_key: str, metadata_key: str, *, optional: bool = False) -> dict[str, Any]:
    """A descriptor entry read from extproc's dynamic metadata. Required (the default): when the
    metadata is absent Envoy sends no descriptor at all; optional: the entry is left out."""
    action: dict[str, Any] = {
        "descriptor_key": descriptor_key,
        "metadata_key": {"key": METADATA_NAMESPACE, "path": [{"key": metadata_key}]},
        "source": "DYNAMIC",
    }
    if optional:
        action["skip_if_absent"] = True
    return {"metadata": action}


def route_rate_limits(config: RoutingConfig, *, every_level: bool = False
                      ) -> list[dict[str, Any]]:
    """The ``rate_limits`` of the routed Envoy route (see the module docstring).

    ``every_level``: the actions of every (kind, level), whatever limits ``config`` sets (what
    ``render`` writes when ``rate_limits:`` is present): Envoy reads its bootstrap once, and a
    limit a reload adds at a level it had none at must bind at once. A descriptor no limit
    matches costs the service a lookup and no store work; the concurrency ones are sent only
    for a request extproc marks ``llm_cap`` (a cap applies to it now). Otherwise: the levels
    ``config`` limits, as extproc builds the descriptors it sends itself."""
    lease = _from_metadata(LEASE_ENTRY, LEASE_METADATA_KEY)
    cap = _from_metadata(CAP_ENTRY, CAP_METADATA_KEY)
    out: list[dict[str, Any]] = []

    def levels(kind: str) -> list[str]:
        if config.rate_limits is None:
            return []
        return list(LEVEL_HEADERS) if every_level else _levels_with(config, kind)

    for level in levels("requests"):
        out.append({"actions": _actions("requests", level)})
    for level in levels("tokens"):
        out.append({
            "actions": _actions("tokens", level, _from_metadata(LEASE_ENTRY, LEASE_METADATA_KEY,
                                                                optional=True)),
            "hits_addend": {"format": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:"
                                      f"{RESERVATION_METADATA_KEY})%"},
        })
        out.append({
            "actions": _actions("tokens", level, lease,
                                _from_metadata(USED_ENTRY, TOKENS_METADATA_KEY),
                                _from_metadata(DONE_ENTRY, DONE_METADATA_KEY)),
            "apply_on_stream_done": True,
            "hits_addend": {"number": 0},
        })
    for level in levels("concurrent"):
        out.append({"actions": _actions("concurrent", level, lease, gate=cap)})
        out.append({
            "actions": _actions("concurrent", level, lease, {"generic_key": {
                "descriptor_key": RELEASE_ENTRY, "descriptor_value": "1"}}, gate=cap),
            "apply_on_stream_done": True,
            "hits_addend": {"number": 0},
        })
    return out
