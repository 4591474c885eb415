"""Poll a config path and swap an immutable snapshot when it changes; reusable by any service.

The signature of a path is (real path, inode, mtime, size) of the file, or of every visible
YAML file for a directory, with symlinks resolved on every poll, so a Kubernetes ConfigMap
update (an atomic swap of the ``..data`` symlink) is seen even though no file is written in
place. A snapshot that fails to load is not swapped in: the old one stays, the error is
logged once per change, and ``on_result(False, message)`` is called (for a metric).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

from llm_sidecar.logs import get_logger

T = TypeVar("T")
log = get_logger("ratelimit.reload")
YAML_SUFFIXES = (".yaml", ".yml")


def _file_signature(path: str) -> tuple[str, int, int, int] | None:
    try:
        real = os.path.realpath(path)
        info = os.stat(real)
    except OSError:
        return None
    return real, info.st_ino, info.st_mtime_ns, info.st_size


def path_signature(path: str) -> Hashable:
    """What changes when the config at ``path`` (a file or a directory of YAML) changes."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return _file_signature(path)
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    entries = tuple(
        (name, _file_signature(os.path.join(path, name)))
        for name in names
        if not name.startswith(".") and name.endswith(YAML_SUFFIXES)
    )
    return real, entries


class Reloader(Generic[T]):
    """Holds the current snapshot of ``load(path)``; :meth:`run` polls for changes."""

    def __init__(
        self,
        path: str | Path,
        load: Callable[[str], T],
        interval_s: float,
        on_result: Callable[[bool, str], None] | None = None,
        errors: tuple[type[Exception], ...] = (Exception,),
    ) -> None:
        self.path = str(path)
        self._load = load
        self._interval_s = interval_s
        self._on_result = on_result
        self._errors = errors
        self._signature = path_signature(self.path)
        self._current = load(self.path)

    def current(self) -> T:
        """The snapshot to use for one whole request (read it once, keep it)."""
        return self._current

    def check_now(self) -> bool:
        """Reload if the path changed; True when a new snapshot was swapped in."""
        signature = path_signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            fresh = self._load(self.path)
        except self._errors as exc:
            log.error("config_reload_failed", path=self.path, error=str(exc))
            if self._on_result is not None:
                self._on_result(False, str(exc))
            return False
        self._current = fresh
        log.info("config_reloaded", path=self.path)
        if self._on_result is not None:
            self._on_result(True, "")
        return True

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled; loading runs off the event loop.

        An unexpected error while loading is logged and polling goes on: a watcher that died
        would leave the service on its old config for good, silently.
        """
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await asyncio.to_thread(self.check_now)
            except Exception as exc:
                log.error("config_reload_crashed", path=self.path, error=repr(exc))
                if self._on_result is not None:
                    self._on_result(False, repr(exc))
