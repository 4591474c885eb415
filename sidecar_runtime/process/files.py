"""Writing a file so that a reader sees the old one or the new one, never half of it."""

from __future__ import annotations

import contextlib
import os


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
