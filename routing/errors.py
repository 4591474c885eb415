"""Config errors of both config formats (the routing YAML and envoyproxy/ratelimit descriptor
files): every problem carries the file and line it came from.

The one config error type of the project: ``llm-sidecar check``, ``extproc`` and ``ratelimit``
print ``str(error)``, one ``FILE:LINE: message`` line per problem, so the three say the same
thing about the same file. ``ratelimit.errors`` re-exports it (ratelimit stands on routing).
"""

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

    @classmethod
    def at(cls, file: str, line: int, message: str) -> ConfigError:
        """An error of one problem."""
        return cls([Problem(file, line, message)])
