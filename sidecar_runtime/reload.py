"""The current config snapshot of a process, swapped as one reference when its files change.

Both services use :class:`Reloader`. Readers call :meth:`Reloader.current` once per request
and keep what it returned, so a request sees the old or the new config, never a mix. Changes
are found by polling a signature of the path (real path, inode, mtime and size of the file, or
of every visible YAML file of a directory), with symlinks resolved on every poll: unlike
inotify on the path, that also sees a Kubernetes ConfigMap update, which swaps the ``..data``
symlink and writes no file in place.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

from sidecar_runtime.logs import get_logger

T = TypeVar("T")
log = get_logger("sidecar_runtime.reload")
YAML_SUFFIXES = (".yaml", ".yml")


def file_signature(path: str) -> tuple[str, int, int, int] | None:
    """What changes when the file does, symlink swaps included; None when it is missing."""
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
        return file_signature(path)
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    entries = tuple(
        (name, file_signature(os.path.join(path, name)))
        for name in names
        if not name.startswith(".") and name.endswith(YAML_SUFFIXES)
    )
    return real, entries


class Reloader(Generic[T]):
    """Holds the snapshot built by ``load(path)`` and rebuilds it when the path changes.

    A config that fails to load (one of ``errors``) leaves the old snapshot in place; the error
    (for a config file, the ``FILE:LINE: message`` lines of ``llm-sidecar check``) is logged
    once per change and reported to ``on_result(False, message)``. A file that changes again
    while it is being loaded (an editor or a copy still writing it) is not judged: the next
    poll loads it again. Loading runs in a thread, so streams are never stalled by it.
    """

    def __init__(self, path: str | Path, load: Callable[[str], T], interval_s: float = 0.5,
                 on_result: Callable[[bool, str], None] | None = None,
                 errors: tuple[type[Exception], ...] = (Exception,)) -> None:
        self.path = str(path)
        self._load = load
        self._interval_s = interval_s
        self._on_result = on_result
        self._errors = errors
        self._signature = path_signature(self.path)
        self._current = load(self.path)
        self._listeners: list[Callable[[T], None]] = []

    def subscribe(self, listener: Callable[[T], None]) -> None:
        """Call ``listener(snapshot)`` after each swap made by :meth:`run`, on the event loop's
        thread (where state shared with requests can be changed without locks)."""
        self._listeners.append(listener)

    def current(self) -> T:
        """The snapshot to use for one whole request (read it once, keep it)."""
        return self._current

    def check_now(self) -> bool:
        """Reload if the path changed; True when a new snapshot was swapped in."""
        signature = path_signature(self.path)
        if signature is None or signature == self._signature:
            return False  # unchanged, or missing for a moment during a swap
        try:
            fresh = self._load(self.path)
        except self._errors as exc:
            if path_signature(self.path) != signature:
                return False  # still being written: judge it when it settles
            self._signature = signature
            log.error("config_reload_failed", path=self.path, error=str(exc),
                      action="kept the previous config")
            self._report(False, str(exc))
            return False
        self._signature = signature
        self._current = fresh
        log.info("config_reloaded", path=self.path)
        self._report(True, "")
        return True

    def _report(self, ok: bool, message: str) -> None:
        if self._on_result is not None:
            self._on_result(ok, message)

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled (the process skeleton runs it as a task
        while the service serves, :mod:`sidecar_runtime.service_process`).

        An unexpected error while loading is logged and polling goes on: a watcher that died
        would leave the service on its old config for good, silently.
        """
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                swapped = await asyncio.to_thread(self.check_now)
            except Exception as exc:
                log.error("config_reload_crashed", path=self.path, error=repr(exc))
                self._report(False, repr(exc))
                continue
            if swapped:
                for listener in self._listeners:
                    listener(self._current)
