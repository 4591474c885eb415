"""Errors of the routing YAML: every problem carries the file and line it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One mistake in a config file, printable as ``FILE:LINE: message``."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class ConfigError(Exception):
    """A config file that cannot be used; ``problems`` lists every mistake found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
