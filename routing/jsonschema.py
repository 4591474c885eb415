"""The routing YAML as a JSON Schema, so editors complete and check it while it is typed.

``llm-sidecar schema`` prints it; a YAML file opts in with a first line such as
``# yaml-language-server: $schema=llm-sidecar.schema.json``. The schema comes from the pydantic
models (descriptions from their attribute docstrings), plus the shapes of the values that the
models check in code (rates, durations, addresses). ``check`` stays the authority: it also
checks what a schema cannot (references between sections, overlapping pools).
"""

from __future__ import annotations

import json
from typing import Any

from routing.schema import TENANT_PATTERN, RoutingConfig
from routing.units import DURATION_PATTERN, HOSTPORT_PATTERN, RATE_PATTERN

SCHEMA_FILE = "llm-sidecar.schema.json"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$"
LOOPBACK_PATTERN = r"^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\]):[0-9]{1,5}$"

# (definition, property) → pattern of its string value (or of its items, for lists).
_PATTERNS = {
    ("EnvoySection", "listen"): HOSTPORT_PATTERN,
    ("EnvoySection", "admin"): LOOPBACK_PATTERN,
    ("EnvoySection", "request_timeout"): DURATION_PATTERN,
    ("EnvoySection", "stream_idle_timeout"): DURATION_PATTERN,
    ("ServicesSection", "extproc"): HOSTPORT_PATTERN,
    ("ServicesSection", "ratelimit"): HOSTPORT_PATTERN,
    ("ClusterSpec", "endpoints"): HOSTPORT_PATTERN,
    ("CacheSpec", "ttl"): DURATION_PATTERN,
    ("Limit", "requests"): RATE_PATTERN,
    ("Limit", "tokens"): RATE_PATTERN,
    ("ApiKey", "sha256"): r"^[0-9a-fA-F]{64}$",
    ("ApiKey", "name"): NAME_PATTERN,
    ("ApiKey", "tenant"): TENANT_PATTERN,
}


def _string_schemas(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The string schemas inside a property: itself, its list items, or its anyOf branches."""
    if prop.get("type") == "string":
        return [prop]
    if prop.get("type") == "array":
        return _string_schemas(prop.get("items", {}))
    return [s for branch in prop.get("anyOf", []) for s in _string_schemas(branch)]


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the routing YAML, version 1."""
    schema = RoutingConfig.model_json_schema(mode="validation")
    defs: dict[str, Any] = schema["$defs"]
    for (definition, prop), pattern in _PATTERNS.items():
        targets = _string_schemas(defs[definition]["properties"][prop])
        if not targets:
            raise AssertionError(f"{definition}.{prop} has no string to pattern")
        for target in targets:
            target["pattern"] = pattern
    for section in ("clusters", "models"):
        schema["properties"][section]["propertyNames"] = {"pattern": NAME_PATTERN}
    schema["properties"]["version"]["description"] = "The format of this file: 1."
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "llm-sidecar routing YAML (version 1)",
        "description": "One file for the whole gateway: vLLM pools, models, API keys, rate limits. "
                       "`llm-sidecar check --config FILE` validates it fully.",
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"
