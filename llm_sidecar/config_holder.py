"""The current config snapshot of a process, swapped as one reference on reload.

Readers call :meth:`ConfigHolder.current` once per request and keep what it returned, so a
request sees the old or the new config, never a mix.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Generic, TypeVar

from llm_sidecar.logs import get_logger

T = TypeVar("T")
log = get_logger("llm_sidecar.reload")


def file_signature(path: str) -> tuple[str, int, int, int] | None:
    """What changes when the file does, symlink swaps (Kubernetes ConfigMaps) included."""
    try:
        real = os.path.realpath(path)
        info = os.stat(real)
    except OSError:
        return None
    return real, info.st_ino, info.st_mtime_ns, info.st_size


class ConfigHolder(Generic[T]):
    """Holds the snapshot built by ``load(path)`` and rebuilds it when the file changes."""

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
            return False
        self._signature = signature
        try:
            fresh = self._load(self.path)
        except Exception as exc:  # the old snapshot stays; the operator reads why in the log
            log.error("config_reload_failed", path=self.path, error=str(exc))
            if self._on_reload:
                self._on_reload(False, str(exc))
            return False
        self._current = fresh
        log.info("config_reloaded", path=self.path)
        if self._on_reload:
            self._on_reload(True, "")
        return True

    async def watch(self, interval_s: float, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set (polling sees ConfigMap symlink swaps that inotify misses)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                self.check_now()
