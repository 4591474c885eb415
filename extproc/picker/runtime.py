"""The endpoint picker as extproc runs it: one :class:`EndpointPicker`, the :class:`Scraper` that
keeps its pools current, and their metrics, following the routing config across reloads.

Requests call :meth:`PickerRuntime.pick` and :meth:`PickerRuntime.done` (never awaiting
anything); the scraper runs in its own tasks on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from extproc.picker.metrics import EndpointMetrics
from extproc.picker.pick import EndpointPicker, Pick, Priority
from extproc.picker.scrape import Scraper
from routing.compiled import Snapshot
from routing.schema import RoutingConfig

FOLLOW_INTERVAL_S = 0.25
"""How often the runtime looks for a reloaded config (an identity check: it costs nothing)."""


class PickerRuntime:
    def __init__(self, snapshot: Callable[[], Snapshot], registry: CollectorRegistry) -> None:
        self._snapshot = snapshot
        self._config: RoutingConfig = snapshot().config
        loop_time = asyncio.get_running_loop().time
        self.picker = EndpointPicker(self._config, clock=loop_time)
        self.scraper = Scraper(self.picker.pools, self._config, clock=loop_time)
        self.metrics = EndpointMetrics(registry, self.picker.pools, loop_time)
        self._follower: asyncio.Task[None] | None = None

    def pick(self, cluster: str, prompt: bytes, priority: Priority) -> Pick | None:
        pick = self.picker.pick(cluster, prompt, priority)
        if pick is not None:
            if pick.endpoint is not None:
                self.metrics.picked(cluster, pick.endpoint, pick.reason)
            elif pick.shed:
                self.metrics.shed(cluster, priority)
        return pick

    def done(self, cluster: str, address: str) -> None:
        self.picker.done(cluster, address)

    def follow(self, config: RoutingConfig) -> None:
        """Adopt ``config`` if it is not the one in force (the picker first: it owns the pools)."""
        if config is self._config:
            return
        self._config = config
        self.picker.update(config)
        self.scraper.update(config)

    async def _follow_loop(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            self.follow(self._snapshot().config)

    async def start(self) -> None:
        await self.scraper.start()
        self._follower = asyncio.create_task(self._follow_loop(), name="picker-follow")

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
            self._follower = None
        await self.scraper.stop()
