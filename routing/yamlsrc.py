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

MAX_NODES = 200_000
"""Values a config may expand to. Aliases make a small text a huge document ("billion
laughs": ten lines of ``&a [*b, *b, ...]`` are 9^9 values), and walking it would spin a CPU
forever, in ``check`` and in every service's reload thread."""
MAX_DEPTH = 64
"""Nesting a config may have (a real one needs about 6)."""


def deep_flow(text: str) -> int | None:
    """The line where ``[``/``{`` brackets (outside quotes) nest past :data:`MAX_DEPTH`, else
    None. Checked before parsing: PyYAML's parser recurses per level and takes seconds to
    reach Python's recursion limit on thousands of brackets."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return None
    depth, line, quote = 0, 1, ""
    for char in text:
        if char == "\n":
            line += 1
        elif quote:
            if char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return line
        elif char in "]}":
            depth = max(0, depth - 1)
    return None


def oversized(root: yaml.Node) -> tuple[int, str] | None:
    """``(line, message)`` when the composed document would expand past :data:`MAX_NODES`
    values or nest deeper than :data:`MAX_DEPTH`, else None. Iterative: no recursion limit."""
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        line = node.start_mark.line + 1
        if count > MAX_NODES:
            return line, (f"the document expands to more than {MAX_NODES} values "
                          "(YAML aliases repeated inside aliases?)")
        if depth > MAX_DEPTH:
            return line, f"nested more than {MAX_DEPTH} levels deep"
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in node.value)
    return None


_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"


class TooBig(Exception):
    """A document nested past :data:`MAX_DEPTH` or expanding past :data:`MAX_NODES`."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def compose_bounded(text: str, loader: type[yaml.SafeLoader]) -> yaml.Node | None:
    """``yaml.compose`` for both config loaders (routing YAML and ratelimit's): raises
    :class:`TooBig` (with its line) instead of recursing or expanding without bound; YAML
    syntax errors propagate as ``yaml.YAMLError``."""
    deep = deep_flow(text)
    if deep is not None:
        raise TooBig(deep, _TOO_DEEP)
    try:
        node = yaml.compose(text, Loader=loader)
    except RecursionError:
        raise TooBig(1, _TOO_DEEP) from None
    too_big = oversized(node) if node is not None else None
    if too_big is not None:
        raise TooBig(*too_big)
    return node


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that treats a repeated mapping key as an error instead of keeping the last."""


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], problems: list[Problem],
          source: str) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                problems.append(Problem(source, key_node.start_mark.line + 1,
                                        "YAML merge keys (<<) are not supported: write the "
                                        "keys out"))
                continue
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
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        # an unknown tag (!!python/...), or a value Python refuses (an integer of 5,000 digits)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem("", node.start_mark.line + 1, f"bad value: {problem}")]) \
            from None


def load_yaml(text: str, source: str) -> Located:
    """Parse one YAML document; syntax errors and duplicate keys raise :class:`ConfigError`."""
    try:
        node = compose_bounded(text, _UniqueKeyLoader)
    except TooBig as exc:
        raise ConfigError([Problem(source, exc.line, exc.message)]) from None
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
    try:
        data = _walk(node, (), lines, problems, source)
    except ConfigError as err:  # from _scalar, which does not know the file name
        raise ConfigError([Problem(source, p.line, p.message) for p in err.problems]) from None
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
