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


class ConfigError(ValueError):
    """A config file that cannot be used; ``problems`` lists every mistake found.

    A ``ValueError`` (as ``json.JSONDecodeError`` is): code that guards a load with
    ``except ValueError`` keeps its old config instead of crashing on a bad file.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
