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

from sidecar_runtime.process.files import replace_file
from sidecar_runtime.process.logs import get_logger

T = TypeVar("T")
log = get_logger("sidecar_runtime.process.reload")
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

    A changed path is loaded once it has stayed the same for one poll (a file written in steps,
    a valid half of it included, is not applied while the writer pauses for less than that),
    and applied only if it did not change again while it was loaded. A config that fails to
    load (one of ``errors``) leaves the old snapshot in place; the error (for a config file,
    the ``FILE:LINE: message`` lines of ``llm-sidecar check``) is logged once per change and
    reported to ``on_result(False, message)``. Loading runs in a thread, so streams are never
    stalled by it.

    ``last_good``: a file where the process keeps a copy of the last config file that loaded
    (a worker under ``--workers``: its supervisor's folder). A process started while the file
    fails to load serves that copy instead, and goes on watching the file: a worker the
    supervisor restarts after an edit that was refused keeps serving, as its siblings do.
    """

    def __init__(self, path: str | Path, load: Callable[[str], T], interval_s: float = 0.5,
                 on_result: Callable[[bool, str], None] | None = None,
                 errors: tuple[type[Exception], ...] = (Exception,),
                 last_good: str | None = None) -> None:
        self.path = str(path)
        self._load = load
        self._interval_s = interval_s
        self._on_result = on_result
        self._errors = errors
        self._last_good = last_good if last_good and not os.path.isdir(self.path) else None
        self._signature = path_signature(self.path)
        self._seen: Hashable = self._signature
        """The signature the last poll saw: a change is loaded once a poll sees it again."""
        try:
            self._current = load(self.path)
        except errors as exc:
            if self._last_good is None or not os.path.exists(self._last_good):
                raise
            self._current = load(self._last_good)
            log.error("config_invalid_serving_last_good", path=self.path, error=str(exc),
                      action="serving the last config that loaded until the file is fixed")
        else:
            self._keep(self._signature)
        self._listeners: list[Callable[[T], None]] = []

    def subscribe(self, listener: Callable[[T], None]) -> None:
        """Call ``listener(snapshot)`` after each swap made by :meth:`run`, on the event loop's
        thread (where state shared with requests can be changed without locks)."""
        self._listeners.append(listener)

    def current(self) -> T:
        """The snapshot to use for one whole request (read it once, keep it)."""
        return self._current

    def check_now(self) -> bool:
        """Reload if the path changed and has stayed the same since the last call; True when a
        new snapshot was swapped in."""
        signature = path_signature(self.path)
        settled = signature == self._seen
        self._seen = signature
        if signature is None or signature == self._signature or not settled:
            return False  # unchanged, missing for a moment during a swap, or still changing
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
        if path_signature(self.path) != signature:
            return False  # changed while it was loaded: what was read may be half of it
        self._signature = signature
        self._current = fresh
        self._keep(signature)
        log.info("config_reloaded", path=self.path)
        self._report(True, "")
        return True

    def _keep(self, signature: Hashable) -> None:
        """Copy the file that just loaded to ``last_good`` (if asked), unless it changed since."""
        if self._last_good is None:
            return
        try:
            data = Path(self.path).read_bytes()
            if path_signature(self.path) != signature:
                return
            replace_file(self._last_good, data)
        except OSError as exc:
            log.warning("config_last_good_not_kept", path=self._last_good, error=str(exc))

    def _report(self, ok: bool, message: str) -> None:
        if self._on_result is not None:
            self._on_result(ok, message)

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled (the process skeleton runs it as a task
        while the service serves, :mod:`sidecar_runtime.process.service_process`).

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
