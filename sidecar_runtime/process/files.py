"""Writing a file so that a reader sees the old one or the new one, never half of it; and the
checked-in files a generator writes (``--check``: which are stale)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` next to ``path``, then rename it over ``path`` (atomic on one file
    system). The scratch name carries the process id, so processes writing the same file at
    once (the workers of one supervisor) never write into each other's scratch."""
    scratch = f"{path}.{os.getpid()}.tmp"
    try:
        with open(scratch, "wb") as handle:
            handle.write(data)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise


def stale_files(files: Mapping[str, str], root: str) -> list[str]:
    """The paths of ``files`` (relative to ``root``) whose content on disk differs from theirs,
    missing ones included."""
    out = []
    for path, text in files.items():
        try:
            with open(os.path.join(root, path), encoding="utf-8") as handle:
                current: str | None = handle.read()
        except FileNotFoundError:
            current = None
        if current != text:
            out.append(path)
    return out


def generate(argv: Sequence[str], files: Callable[[], Mapping[str, str]], root: str,
             command: str) -> int:
    """The ``main`` of a generator of checked-in files (``command``): no argument writes every
    file of ``files()`` under ``root`` and prints its path; ``--check`` writes nothing and
    lists the stale ones (exit 1 when there are)."""
    if list(argv) == ["--check"]:
        paths = stale_files(files(), root)
        for path in paths:
            print(f"{path}: stale; run `{command}`", file=sys.stderr)
        return 1 if paths else 0
    if argv:
        print(f"usage: {command} [--check]", file=sys.stderr)
        return 2
    for path, text in files().items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        replace_file(full, text.encode("utf-8"))
        print(path)
    return 0
