"""The routing YAML's ``rate_limits:`` as envoyproxy/ratelimit descriptors and Envoy route actions.

One descriptor tree per kind (``kind=requests``, ``kind=tokens``), one branch per level
(``api_key``, ``tenant``, ``model``) keyed by the ``x-llm-*`` header extproc sets. Token limits
carry ``debt: true``: they are checked with ``hits_addend: 0`` when a request starts and charged
with the real usage (dynamic metadata from extproc) when its stream is done (CONTRACT §7).
"""

from __future__ import annotations

from typing import Any

from routing.compiled import listed_key_id
from routing.loader import load_config
from routing.schema import LevelLimits, Limit, RoutingConfig
from routing.units import parse_rate

DOMAIN = "llm-sidecar"
METADATA_NAMESPACE = "llm_sidecar"
TOKENS_METADATA_KEY = "llm_tokens"
CLUSTER_METADATA_KEY = "cluster"
"""The pool extproc chose: the only thing Envoy's routes to a pool match on."""
LEVEL_HEADERS = {"api_key": "x-llm-key-id", "tenant": "x-llm-tenant", "model": "x-llm-model"}
_UNITS = (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))


def _window(window_s: int) -> dict[str, Any]:
    """The largest unit that divides the window, with a multiplier for ``N/5m``-style rates."""
    for unit, seconds in _UNITS:
        if window_s % seconds == 0:
            multiple = window_s // seconds
            return {"unit": unit} if multiple == 1 else {"unit": unit, "unit_multiplier": multiple}
    raise AssertionError(window_s)


def _limit(rate_text: str, name: str, *, burst: int | None = None,
           debt: bool = False) -> dict[str, Any]:
    rate = parse_rate(rate_text)
    out: dict[str, Any] = {"name": name, "requests_per_unit": rate.amount, **_window(rate.window_s)}
    if burst is not None:
        out["burst"] = burst
    if debt:
        out["debt"] = True
    return out


def _merged(default: Limit | None, override: Limit) -> Limit:
    """An override replaces what it sets; unset fields come from the level's default.

    ``burst`` belongs to the requests rate: a new requests rate without a burst gets the default
    burst of that rate (its N), not the old rate's burst.
    """
    if default is None:
        return override
    requests = override.requests or default.requests
    burst = override.burst if override.requests else (override.burst or default.burst)
    return Limit(requests=requests, burst=burst, tokens=override.tokens or default.tokens)


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


def descriptor_document(path: str) -> dict[str, Any]:
    """What ``ratelimit.yaml`` holds for the routing YAML at ``path``."""
    return descriptors(load_config(path))


def descriptors(config: RoutingConfig) -> dict[str, Any]:
    limits = config.rate_limits
    requests: list[dict[str, Any]] = []
    tokens: list[dict[str, Any]] = []
    if limits is not None:
        for level in LEVEL_HEADERS:
            section: LevelLimits | None = getattr(limits, level)
            if section is None:
                continue
            for value, label, limit in _level_entries(config, level, section):
                base: dict[str, Any] = {"key": level}
                if value is not None:
                    base["value"] = value
                if limit.requests:
                    requests.append({**base, "rate_limit": _limit(
                        limit.requests, f"{label}:requests", burst=limit.burst)})
                if limit.tokens:
                    tokens.append({**base, "rate_limit": _limit(
                        limit.tokens, f"{label}:tokens", debt=True)})
    doc: dict[str, Any] = {"domain": DOMAIN, "descriptors": []}
    if limits is not None:
        doc["on_backend_error"] = limits.on_backend_error
    if requests:
        doc["descriptors"].append({"key": "kind", "value": "requests", "descriptors": requests})
    if tokens:
        doc["descriptors"].append({"key": "kind", "value": "tokens", "descriptors": tokens})
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


def _actions(kind: str, level: str) -> list[dict[str, Any]]:
    return [
        {"generic_key": {"descriptor_key": "kind", "descriptor_value": kind}},
        {"request_headers": {"header_name": LEVEL_HEADERS[level], "descriptor_key": level}},
    ]


def route_rate_limits(config: RoutingConfig) -> list[dict[str, Any]]:
    """The ``rate_limits`` of the routed Envoy route.

    Requests cost 1 when the request starts. Token buckets are checked (``hits_addend: 0``: admit
    while not empty) when it starts, and charged the real usage when the stream is done.
    """
    out: list[dict[str, Any]] = []
    for level in _levels_with(config, "requests"):
        out.append({"actions": _actions("requests", level)})
    for level in _levels_with(config, "tokens"):
        out.append({"actions": _actions("tokens", level), "hits_addend": {"number": 0}})
        out.append({
            "actions": _actions("tokens", level),
            "apply_on_stream_done": True,
            "hits_addend": {"format": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:"
                                      f"{TOKENS_METADATA_KEY})%"},
        })
    return out
