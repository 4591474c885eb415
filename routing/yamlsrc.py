"""YAML reading that remembers where every key and value stood, for ``FILE:LINE`` errors.

The one reader of both config formats: the routing YAML (``routing.loader``) and
envoyproxy/ratelimit descriptor files (``ratelimit.loader``), so both bound aliases and nesting,
refuse duplicate and merge keys, and locate problems the same way. Files are read through
:func:`read_text` (LLMModel files and model configs too): regular files of bounded size only, so
a FIFO or a device named as a config cannot hang a reload, nor a huge file fill the memory.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

import yaml

from routing.errors import ConfigError, Problem

Path = tuple[str | int, ...]


@dataclass
class Located:
    """Plain data from a YAML document plus the 1-based line of each path in it.

    ``lines[path]`` is the line where the entry at ``path`` starts (the key's line for a mapping
    entry, the item's line for a list item). ``raw`` holds the source text of scalars, so a
    descriptor's ``value: 0500`` stays ``"0500"`` and is not read as a number.
    """

    source: str
    data: Any
    lines: dict[Path, int] = field(default_factory=dict)
    raw: dict[Path, str] = field(default_factory=dict)

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


@dataclass(frozen=True)
class Wording:
    """How a syntax error and a repeated key are worded. The two formats keep their own words
    for these (the descriptor format's follow envoyproxy/ratelimit); every other problem is
    worded the same for both."""

    syntax: str
    syntax_hint: str
    duplicate_hint: str


ROUTING = Wording("YAML syntax", " " + _SYNTAX_HINT, ": YAML keeps only the last, so merge the two")
DESCRIPTORS = Wording("invalid YAML", "", "")

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


class _Walk:
    """Turns a composed node tree into plain data, recording lines, raw scalars and problems."""

    def __init__(self, located: Located, wording: Wording) -> None:
        self.located = located
        self.wording = wording
        self.problems: list[Problem] = []

    def _add(self, node: yaml.Node, message: str) -> None:
        self.problems.append(Problem(self.located.source, node.start_mark.line + 1, message))

    def build(self, node: yaml.Node, path: Path) -> Any:
        lines = self.located.lines
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    self._add(key_node, "YAML merge keys (<<) are not supported: write the keys out")
                    continue
                key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                if key is None or isinstance(key, list | dict):
                    self._add(key_node, "a mapping key must be a plain value")
                    continue
                child = (*path, key)
                if key in out:
                    self._add(key_node, f"duplicate key {key!r} (first at line {lines[child]})"
                                        f"{self.wording.duplicate_hint}")
                lines[child] = key_node.start_mark.line + 1
                out[key] = self.build(value_node, child)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        self.located.raw[path] = str(node.value)
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


def load_yaml(text: str, source: str, wording: Wording = ROUTING) -> Located:
    """Parse one YAML document; syntax errors and duplicate keys raise :class:`ConfigError`
    (every duplicate or merge key, each at its line). An empty text gives ``data=None``."""
    try:
        node = compose_bounded(text, _UniqueKeyLoader)
    except TooBig as exc:
        raise ConfigError.at(source, exc.line, exc.message) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or str(exc)
        raise ConfigError.at(source, line, f"{wording.syntax}: {problem}{wording.syntax_hint}") \
            from None
    except yaml.YAMLError as exc:
        raise ConfigError.at(source, 1, f"{wording.syntax}: {exc}") from None
    if node is None:
        return Located(source, None, {(): 1})
    walk = _Walk(Located(source, None), wording)
    try:
        walk.located.data = walk.build(node, ())
    except ConfigError as err:  # from _scalar, which does not know the file name
        raise ConfigError([Problem(source, p.line, p.message) for p in err.problems]) from None
    if walk.problems:
        raise ConfigError(walk.problems)
    return walk.located


MAX_YAML_BYTES = 64 << 20
"""The largest config file read (the routing YAML, a descriptor file): far above any real one,
a long ``api_keys`` list included, and far below what would strain a service's memory."""


def read_text(path: str, limit: int) -> str:
    """A regular file of at most ``limit`` bytes as UTF-8 text; raises ``ValueError`` saying why
    not. A FIFO, a device (a link to /dev/zero) or a huge file is refused before it is opened,
    so a bad file in a watched folder cannot hang the reader or fill its memory."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, device or socket is not read)")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than the {limit} read")
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ValueError(f"more than the {limit} bytes read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


def read_config_text(path: str) -> str:
    """A config file's text (:func:`read_text` up to :data:`MAX_YAML_BYTES`); raises
    :class:`ConfigError` at its first line saying why not."""
    try:
        return read_text(path, MAX_YAML_BYTES)
    except ValueError as exc:
        why = str(exc).removeprefix("cannot read: ")
        raise ConfigError.at(path, 1, f"cannot read the file: {why}") from None


def read_yaml(path: str) -> Located:
    """Read and parse the file at ``path``."""
    return load_yaml(read_config_text(path), path)
