"""YAML text to plain data plus the line of every node, so config errors can say ``FILE:LINE``.

A :class:`Document` is what the descriptor loader validates. It can come from a YAML file
(:func:`parse_yaml`, lines from PyYAML's node marks) or from a dict built by another module
(for example the routing YAML converter), with an optional map of paths to lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ratelimit.errors import ConfigError
from routing.yamlsrc import TooBig, compose_bounded

Path = tuple[str | int, ...]
"""Where a value sits in a document: mapping keys and list indexes from the root."""


@dataclass(frozen=True)
class Document:
    """Plain data (dicts, lists, scalars) with the line of each path.

    ``lines[path]`` is the line where the entry at ``path`` starts (the key's line for a
    mapping entry, the item's line for a list item). ``raw`` holds the source text of
    scalars, so ``value: 0500`` stays ``"0500"`` and is not read as a number.
    """

    source: str
    data: Any
    lines: Mapping[Path, int] = field(default_factory=dict)
    raw: Mapping[Path, str] = field(default_factory=dict)

    def line(self, path: Path) -> int:
        """The line of ``path``, else of its nearest ancestor that has one, else 1."""
        probe = path
        while True:
            found = self.lines.get(probe)
            if found is not None:
                return found
            if not probe:
                return 1
            probe = probe[:-1]

    def error(self, path: Path, message: str) -> ConfigError:
        """A :class:`ConfigError` pointing at ``path``."""
        return ConfigError(self.source, self.line(path), message)


def parse_yaml(text: str, source: str) -> Document:
    """Parse one YAML document; syntax errors, duplicate keys and non-string keys raise
    :class:`ConfigError` with the line of the problem. An empty text gives ``data=None``."""
    try:
        node = compose_bounded(text, yaml.SafeLoader)
    except TooBig as exc:
        raise ConfigError(source, exc.line, f"invalid YAML: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(source, line, f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, 1, f"invalid YAML: {exc}") from None
    lines: dict[Path, int] = {}
    raw: dict[Path, str] = {}
    if node is None:
        return Document(source, None, lines, raw)
    lines[()] = node.start_mark.line + 1
    builder = _Builder(source, lines, raw)
    return Document(source, builder.build(node, ()), lines, raw)


class _Builder:
    """Turns a composed node tree into plain data, recording lines and raw scalars."""

    def __init__(self, source: str, lines: dict[Path, int], raw: dict[Path, str]) -> None:
        self._source = source
        self._lines = lines
        self._raw = raw
        self._constructor = SafeConstructor()

    def build(self, node: Node, path: Path) -> Any:
        if isinstance(node, MappingNode):
            return self._mapping(node, path)
        if isinstance(node, SequenceNode):
            items: list[Any] = []
            for index, item in enumerate(node.value):
                self._lines[(*path, index)] = item.start_mark.line + 1
                items.append(self.build(item, (*path, index)))
            return items
        assert isinstance(node, ScalarNode)
        self._raw[path] = str(node.value)
        try:
            return self._constructor.construct_object(node, deep=True)
        except ConstructorError as exc:
            line = node.start_mark.line + 1
            raise ConfigError(self._source, line, f"invalid YAML: {exc.problem}") from None
        except (ValueError, OverflowError) as exc:  # e.g. an integer of 5,000 digits
            line = node.start_mark.line + 1
            raise ConfigError(self._source, line, f"invalid YAML: {exc}") from None

    def _mapping(self, node: MappingNode, path: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError(self._source, line, "YAML merge keys (<<) are not supported")
            if not isinstance(key_node, ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise ConfigError(self._source, line, "mapping keys must be strings")
            key = str(key_node.value)
            if key in out:
                first = self._lines[(*path, key)]
                raise ConfigError(self._source, line, f"duplicate key '{key}' (first at line {first})")
            self._lines[(*path, key)] = line
            out[key] = self.build(value_node, (*path, key))
        return out
