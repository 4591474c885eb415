"""The current config snapshot of a process, swapped as one reference on reload.

Readers call :meth:`ConfigHolder.current` once per request and keep what it returned, so a
request sees the old or the new config, never a mix. Changes are found by polling the file's
signature (real path, inode, mtime, size): polling, unlike inotify on the path, also sees a
Kubernetes ConfigMap update, which swaps the ``..data`` symlink and writes no file in place.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Generic, TypeVar

from llm_sidecar.logs import get_logger

T = TypeVar("T")
log = get_logger("llm_sidecar.reload")
Signature = tuple[str, int, int, int]


def file_signature(path: str) -> Signature | None:
    """What changes when the file does, symlink swaps (Kubernetes ConfigMaps) included."""
    try:
        real = os.path.realpath(path)
        info = os.stat(real)
    except OSError:
        return None
    return real, info.st_ino, info.st_mtime_ns, info.st_size


class ConfigHolder(Generic[T]):
    """Holds the snapshot built by ``load(path)`` and rebuilds it when the file changes.

    A file that fails to load leaves the old snapshot in place; the error (for a routing YAML,
    the ``FILE:LINE: message`` lines of ``llm-sidecar check``) is logged once per change and
    reported to ``on_reload(False, message)``. A file that changes again while it is being
    loaded (an editor or a copy still writing it) is not judged: the next poll loads it again.
    """

    def __init__(self, path: str, load: Callable[[str], T],
                 on_reload: Callable[[bool, str], None] | None = None) -> None:
        self.path = path
        self._load = load
        self._on_reload = on_reload
        self._signature = file_signature(path)
        self._current = load(path)

    def current(self) -> T:
        return self._current

    def check_now(self) -> bool:
        """Reload if the file changed; True when a new snapshot was swapped in."""
        signature = file_signature(self.path)
        if signature is None or signature == self._signature:
            return False  # unchanged, or missing for a moment during a swap
        try:
            fresh = self._load(self.path)
        except Exception as exc:  # any failure keeps the old snapshot; the log says why
            if file_signature(self.path) != signature:
                return False  # still being written: judge it when it settles
            self._signature = signature
            log.error("config_reload_failed", path=self.path, error=str(exc),
                      action="kept the previous config")
            if self._on_reload:
                self._on_reload(False, str(exc))
            return False
        self._signature = signature
        self._current = fresh
        log.info("config_reloaded", path=self.path, file=signature[0])
        if self._on_reload:
            self._on_reload(True, "")
        return True

    async def watch(self, interval_s: float, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; loading runs in a thread so streams are never stalled."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                await asyncio.to_thread(self.check_now)
