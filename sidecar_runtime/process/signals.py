"""SIGINT and SIGTERM as a graceful stop, the one way every long-running process here does it
(extproc, ratelimit, their ``--workers`` supervisor, the simulator)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (the caller drains) instead of killing the process."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError):  # no signal handlers on this loop
            loop.add_signal_handler(sig, stop.set)


def remove_stop_handlers() -> None:
    """Give SIGINT and SIGTERM back their defaults (a second signal then kills at once)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(sig)
