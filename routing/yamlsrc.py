"""YAML reading that remembers where every key and value stood, for ``FILE:LINE`` errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from routing.errors import ConfigError, Problem

Path = tuple[str | int, ...]


@dataclass
class Located:
    """Plain data from a YAML document plus the 1-based line of each path in it."""

    source: str
    data: Any
    lines: dict[Path, int] = field(default_factory=dict)

    def line_of(self, path: Path) -> int:
        """The line of ``path``, or of its nearest ancestor that has one."""
        probe = tuple(path)
        while probe:
            if probe in self.lines:
                return self.lines[probe]
            probe = probe[:-1]
        return self.lines.get((), 1)

    def problem(self, path: Path, message: str) -> Problem:
        return Problem(self.source, self.line_of(path), message)


_SYNTAX_HINT = "(check indentation, quotes and closing brackets on this line and the one above)"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that treats a repeated mapping key as an error instead of keeping the last."""


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], problems: list[Problem],
          source: str) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or isinstance(key, list | dict):
                problems.append(Problem(source, key_node.start_mark.line + 1,
                                        "a mapping key must be a plain value"))
                continue
            child = (*path, key)
            if key in out:
                problems.append(Problem(source, key_node.start_mark.line + 1,
                                        f"duplicate key {key!r} (first at line {lines[child]}): "
                                        "YAML keeps only the last, so merge the two"))
            lines[child] = key_node.start_mark.line + 1
            out[key] = _walk(value_node, child, lines, problems, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(item, (*path, i), lines, problems, source) for i, item in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: yaml.Node) -> Any:
    loader = _UniqueKeyLoader("")
    return loader.construct_object(node, deep=True)


def load_yaml(text: str, source: str) -> Located:
    """Parse one YAML document; syntax errors and duplicate keys raise :class:`ConfigError`."""
    try:
        node = yaml.compose(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ConfigError([Problem(source, line, f"YAML syntax: {exc.problem or exc} "
                                   f"{_SYNTAX_HINT}")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(source, 1, f"YAML syntax: {exc}")]) from None
    if node is None:
        return Located(source, None, {(): 1})
    lines: dict[Path, int] = {}
    problems: list[Problem] = []
    data = _walk(node, (), lines, problems, source)
    if problems:
        raise ConfigError(problems)
    return Located(source, data, lines)


def read_yaml(path: str) -> Located:
    """Read and parse the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(path, 1, f"cannot read the file: {exc}")]) from None
    return load_yaml(text, path)
