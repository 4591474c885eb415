"""The routing YAML reference (``docs/reference/config.md``) from its JSON Schema.

Every key at every depth (``$ref``, ``anyOf``, maps and lists followed), in schema order, with
its type, default, description and an example: the schema's ``examples``, else the example
config's value, else one derived from the key's type (the page marks those).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from routing.jsonschema import LOOPBACK_PATTERN, NAME_PATTERN, json_schema
from routing.schema import TENANT_PATTERN
from routing.units import DURATION_PATTERN, HOSTPORT_PATTERN, RATE_PATTERN

MAP_KEY = "<name>"
"""The path segment of a map's entries (``clusters.<name>.endpoints``)."""
LIST_ITEM = "[]"
"""The path segment of a list's items (``api_keys[].name``)."""

# A valid value for each string pattern of the schema, for keys that have neither an example
# nor a default; tests/test_docs.py checks every example against its key's schema.
_PATTERN_SAMPLES = {
    DURATION_PATTERN: "30s",
    RATE_PATTERN: "100/s",
    HOSTPORT_PATTERN: "10.0.0.7:8000",
    LOOPBACK_PATTERN: "127.0.0.1:9901",
    NAME_PATTERN: "team-a-prod",
    TENANT_PATTERN: "team-a",
    r"^[0-9a-fA-F]{64}$": hashlib.sha256(b"sk-example").hexdigest(),
    r"^[a-zA-Z_:][a-zA-Z0-9_:]*$": "engine:requests_waiting",
    r"^https?://\S*\{host\}\S*$": "http://{host}:9400/metrics",
}


def _code(value: Any) -> str:
    return f"`{json.dumps(value)}`"


@dataclass(frozen=True)
class Key:
    """One key of the routing YAML: ``path`` as the page names it, its property schema
    (``$ref`` left in place), whether its object requires it, and the definition holding it."""

    path: str
    schema: Mapping[str, Any]
    required: bool
    owner: str


def _resolve(root: Mapping[str, Any], ref: str) -> tuple[str, Mapping[str, Any]]:
    name = ref.removeprefix("#/$defs/")
    return name, root["$defs"][name]


def _members(root: Mapping[str, Any], schema: Mapping[str, Any], path: str, owner: str,
             chain: tuple[str, ...] = ()) -> Iterator[Key]:
    """The keys inside ``schema`` (its properties, map values, list items, ``$ref`` and
    ``anyOf`` branches followed), depth first in schema order."""
    if "$ref" in schema:
        name, target = _resolve(root, schema["$ref"])
        if name not in chain:  # a recursive definition is listed once
            yield from _members(root, target, path, name, (*chain, name))
    for branch in schema.get("anyOf", ()):
        yield from _members(root, branch, path, owner, chain)
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        child = f"{path}.{name}" if path else name
        yield Key(child, prop, name in required, owner)
        yield from _members(root, prop, child, owner, chain)
    values = schema.get("additionalProperties")
    if isinstance(values, dict):
        yield from _members(root, values, f"{path}.{MAP_KEY}", owner, chain)
    items = schema.get("items")
    if isinstance(items, dict):
        yield from _members(root, items, f"{path}{LIST_ITEM}", owner, chain)


def config_keys(root: Mapping[str, Any] | None = None) -> list[Key]:
    """Every key of the routing YAML, in schema order, each path once."""
    schema = json_schema() if root is None else root
    seen: dict[str, Key] = {}
    for key in _members(schema, schema, "", "RoutingConfig"):
        seen.setdefault(key.path, key)
    return list(seen.values())


def _branches(root: Mapping[str, Any], schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``schema`` as a list of alternatives, ``$ref`` resolved."""
    if "$ref" in schema:
        return [_resolve(root, schema["$ref"])[1]]
    if "anyOf" in schema:
        return [b for branch in schema["anyOf"] for b in _branches(root, branch)]
    return [schema]


def _bounds(schema: Mapping[str, Any]) -> list[str]:
    signs = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
             ("exclusiveMaximum", "<"), ("minLength", "length >="), ("maxLength", "length <="),
             ("minItems", "items >="), ("minProperties", "entries >="))
    out = [f"{sign} {schema[word]}" for word, sign in signs if word in schema]
    if "pattern" in schema:
        out.append(f"matching `{schema['pattern']}`")
    if "pattern" in schema.get("propertyNames", {}):
        out.append(f"names matching `{schema['propertyNames']['pattern']}`")
    return out


def type_text(root: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    """A key's type in words: ``string (matching `^...$`)``, ``list of string``, ``object``."""
    if "$ref" in schema:
        return "object"
    if "anyOf" in schema:
        kinds = list(dict.fromkeys(type_text(root, b) for b in schema["anyOf"]))
        return (", or " if any(" " in kind for kind in kinds) else " or ").join(kinds)
    if "const" in schema:
        return f"the constant {_code(schema['const'])}"
    if "enum" in schema:
        return "one of " + ", ".join(_code(value) for value in schema["enum"])
    kind = str(schema.get("type", "any"))
    if kind == "array":
        kind = f"list of {type_text(root, schema.get('items', {}))}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        kind = f"map of name to {type_text(root, schema['additionalProperties'])}"
    bounds = _bounds(schema)
    return f"{kind} ({', '.join(bounds)})" if bounds else kind


def default_text(root: Mapping[str, Any], key: Key) -> str:
    """What an absent key means: its schema default, or for a key without one (a pydantic
    ``default_factory``) the empty list or map, or an object whose keys take their defaults."""
    if key.required:
        return "none: required"
    if "default" in key.schema:
        return _code(key.schema["default"])
    kinds = {b.get("type") for b in _branches(root, key.schema)}
    if "array" in kinds:
        return "`[]`"
    if any("properties" in b for b in _branches(root, key.schema)):
        return "an object whose keys take their defaults"
    if "object" in kinds:
        return "`{}`"
    return "none"


def derived_example(root: Mapping[str, Any], schema: Mapping[str, Any], name: str) -> Any:
    """A value of ``schema`` made from its type, default and bounds (``name``: the key's, for
    a placeholder string)."""
    if schema.get("examples"):
        return schema["examples"][0]
    if schema.get("default") is not None:
        return schema["default"]
    if "$ref" in schema:
        return derived_example(root, _resolve(root, schema["$ref"])[1], name)
    if "anyOf" in schema:
        usable = [b for b in schema["anyOf"] if b.get("type") != "null"]
        return derived_example(root, usable[0], name)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        if "properties" in schema:
            return {prop: derived_example(root, sub, prop)
                    for prop, sub in schema["properties"].items()
                    if prop in schema.get("required", ())}
        values = schema.get("additionalProperties")
        entry = _PATTERN_SAMPLES.get(schema.get("propertyNames", {}).get("pattern", ""), MAP_KEY)
        return {entry: derived_example(root, values, name)} if isinstance(values, dict) else {}
    if kind == "array":
        return [derived_example(root, schema.get("items", {}), name)]
    if kind == "boolean":
        return True
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1)
        return max(int(low), 1) if kind == "integer" else float(max(low, 1))
    if kind == "string":
        return _PATTERN_SAMPLES.get(schema.get("pattern", ""), f"<{name}>")
    return None


def _found(value: Any, parts: Sequence[str]) -> Iterator[tuple[Any, Any]]:
    """(the path with map names and list positions filled in, value) for each place ``parts``
    reaches in the example config."""
    if not parts:
        yield (), value
        return
    head, rest = parts[0], parts[1:]
    if head == MAP_KEY and isinstance(value, dict):
        for name in value:
            for path, found in _found(value[name], rest):
                yield (name, *path), found
    elif head == LIST_ITEM and isinstance(value, list):
        for item in value:
            for path, found in _found(item, rest):
                yield (LIST_ITEM, *path), found
    elif isinstance(value, dict) and head in value:
        for path, found in _found(value[head], rest):
            yield (head, *path), found


def _parts(path: str) -> list[str]:
    return [p for part in path.split(".") for p in (
        [part[: -len(LIST_ITEM)], LIST_ITEM] if part.endswith(LIST_ITEM) else [part])]


def _nest(parts: Sequence[str], value: Any) -> Any:
    for part in reversed(parts):
        value = [value] if part == LIST_ITEM else {part: value}
    return value


def _named(example: Any, parts: Sequence[str]) -> list[str]:
    """``parts`` with each map segment named as the example config's first entry there (a
    real cluster or model name reads better than ``<name>``), where it has one."""
    out, here = [], example
    for part in parts:
        name = part
        if part == MAP_KEY and isinstance(here, dict) and here:
            name = next(iter(here))
        if part == LIST_ITEM:
            here = here[0] if isinstance(here, list) and here else None
        else:
            here = here.get(name) if isinstance(here, dict) else None
        out.append(name)
    return out


@dataclass(frozen=True)
class Example:
    """A key's example ``value``, and ``document``: that value at the key's place in a
    routing YAML. ``derived``: made from the type, not taken from the schema or the example
    config (the page says it is a valid value, not advice)."""

    value: Any
    document: Any
    derived: bool


def examples(root: Mapping[str, Any], example: Mapping[str, Any]) -> dict[str, Example]:
    """Key path → its example: the schema's ``examples``, else the example config's value
    there, else its value for the same key of the same definition elsewhere (``Limit.tokens``
    of another level), else its default, else one derived from its type."""
    keys = config_keys(root)
    from_file: dict[str, tuple[Any, Any]] = {}
    for key in keys:
        for path, value in _found(example, _parts(key.path)):
            from_file[key.path] = (path, value)
            break
    by_owner: dict[tuple[str, str], Any] = {}
    for key in keys:
        # Values only: a map's or an object's names belong to where it is (tenants, models).
        if key.path in from_file and not isinstance(from_file[key.path][1], dict):
            by_owner.setdefault((key.owner, _parts(key.path)[-1]), from_file[key.path][1])
    out = {}
    for key in keys:
        parts = _parts(key.path)
        named = _named(example, parts)
        if key.schema.get("examples"):
            out[key.path] = Example(key.schema["examples"][0], named, False)
        elif key.path in from_file:
            out[key.path] = Example(from_file[key.path][1], from_file[key.path][0], False)
        elif (key.owner, parts[-1]) in by_owner:
            out[key.path] = Example(by_owner[(key.owner, parts[-1])], named, False)
        else:
            default = key.schema.get("default")
            out[key.path] = Example(derived_example(root, key.schema, parts[-1]), named,
                                    default is None)
    for key in reversed(keys):  # children first: an object made of its keys' examples
        out[key.path] = _spelled(key.path, keys, out)
    return {path: Example(e.value, _nest(e.document, e.value), e.derived)
            for path, e in out.items()}


def _spelled(path: str, keys: Sequence[Key], out: Mapping[str, Example]) -> Example:
    """A derived object (or map entry) example made of its keys' examples that are not
    derived themselves (defaults, the example config's), so ``weights`` shows every weight."""
    mine = out[path]
    if not mine.derived or not isinstance(mine.value, dict):
        return mine
    entry = next(iter(mine.value), None)
    is_map = isinstance(mine.value.get(entry), dict) and entry is not None
    prefix = f"{path}.{MAP_KEY}." if is_map else f"{path}."
    value = {k.path[len(prefix):]: out[k.path].value for k in keys
             if k.path.startswith(prefix) and "." not in k.path[len(prefix):]
             and LIST_ITEM not in k.path[len(prefix):] and not out[k.path].derived}
    if not value:
        return mine
    inner = mine.value[entry] if is_map else mine.value
    value = {**inner, **value}
    return Example({entry: value} if is_map else value, mine.document, False)


def _description(root: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    if "description" in schema:
        return str(schema["description"])
    for branch in schema.get("anyOf", ()):
        if "$ref" in branch:
            return _description(root, branch)
    if "$ref" in schema:
        return str(_resolve(root, schema["$ref"])[1].get("description", ""))
    return ""


def description(root: Mapping[str, Any], key: Key) -> str:
    """The key's description: its own, else its definition's; empty when the schema has none."""
    return " ".join(_description(root, key.schema).split())


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False, width=96,
                          allow_unicode=True)


def config_page() -> str:
    root = json_schema()
    with resources.files("llm_sidecar").joinpath("example.yaml").open(encoding="utf-8") as f:
        example = yaml.safe_load(f)
    samples = examples(root, example)
    lines = ["# Routing YAML reference\n",
             f"{root['description']}\n",
             f"Every key, at every depth. `{MAP_KEY}` stands for the name of a map entry (a "
             f"cluster, a model, a tenant), `{LIST_ITEM}` for each item of a list. Examples "
             "come from `llm_sidecar/example.yaml` where it sets the key. Editors complete and "
             "check the file with the schema: first line "
             "`# yaml-language-server: $schema=llm-sidecar.schema.json`.\n"]
    for key in config_keys(root):
        level = "##" if "." not in key.path and LIST_ITEM not in key.path else "###"
        text = description(root, key)
        lines.append(f"{level} `{key.path}`\n")
        if text:
            lines.append(f"{text}\n")
        lines.append(f"- Type: {type_text(root, key.schema)}")
        lines.append(f"- Default: {default_text(root, key)}\n")
        sample = samples[key.path]
        note = "# a valid value, not advice\n" if sample.derived else ""
        lines.append(f"```yaml\n{note}{_yaml(sample.document)}```\n")
    return "\n".join(lines)
