"""The commands reference (``docs/reference/commands.md``): each ``--help``, at a fixed width."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

HELP_COLUMNS = "100"
"""argparse wraps at the terminal's width; the page is wrapped at this one on every machine."""


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Name → parser of each subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@contextlib.contextmanager
def _fixed_terminal() -> Iterator[None]:
    """argparse wraps help at the terminal's width (``COLUMNS``); colour off (Python 3.14)."""
    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR")}
    os.environ.update(COLUMNS=HELP_COLUMNS, NO_COLOR="1")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def help_texts() -> dict[str, str]:
    """Command line → its ``--help`` output: ``llm-sidecar``, then each subcommand."""
    from llm_sidecar.cli import _parser

    parser = _parser()
    with _fixed_terminal():
        out = {parser.prog: parser.format_help()}
        out.update({sub.prog: sub.format_help() for sub in subcommands(parser).values()})
    return out


def commands_page() -> str:
    texts = help_texts()
    lines = ["# Commands reference\n",
             "`llm-sidecar COMMAND --help` prints the same. Settings that are not flags come "
             "from `LLM_SIDECAR_*` environment variables.\n"]
    for command, text in texts.items():
        lines.append(f"## `{command}`\n")
        lines.append(f"```text\n{text.rstrip()}\n```\n")
    return "\n".join(lines)
