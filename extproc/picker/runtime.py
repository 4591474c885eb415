"""The endpoint picker as extproc runs it: one :class:`EndpointPicker`, the :class:`Scraper` that
keeps its pools current, and their metrics, following the routing config across reloads.

Requests call :meth:`PickerRuntime.pick` and :meth:`PickerRuntime.done` (never awaiting
anything); the scraper runs in its own tasks on the same event loop.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from extproc.actions import Hold, Waited
from extproc.flow.control import FlowControl
from extproc.flow.metrics import FlowMetrics
from extproc.picker.metrics import EndpointMetrics
from extproc.picker.pick import EndpointPicker, Pick, Priority
from extproc.picker.scoring import NO_WORK, Work
from extproc.picker.scrape import Scraper
from routing.schema import RoutingConfig
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.picker")


class PickerRuntime:
    def __init__(self, config: RoutingConfig, registry: CollectorRegistry) -> None:
        self._config = config
        loop_time = self._clock = asyncio.get_running_loop().time
        self.picker = EndpointPicker(self._config, clock=loop_time)
        self.flow = FlowControl(self.picker.has_room, FlowMetrics(registry), loop_time)
        self.scraper = Scraper(self.picker.pools, self._config, clock=loop_time,
                               on_scrape=self.flow.kick)
        self.metrics = EndpointMetrics(registry, self.picker.pools, loop_time)

    def pick(self, cluster: str, prompt: bytes, priority: Priority,
             salt: str | None = None, work: Work = NO_WORK,
             room_only: bool = False) -> Pick | None:
        pick = self.picker.pick(cluster, prompt, priority, salt, work, room_only)
        if pick is not None:
            if pick.endpoint is not None:
                self.metrics.picked(cluster, pick.endpoint, pick.reason)
            elif pick.shed:
                self.metrics.shed(cluster, priority)
        return pick

    def done(self, cluster: str, address: str, unread: bool = False) -> None:
        self.picker.done(cluster, address, unread)
        self.flow.kick(cluster)  # its slot may be the room a waiting request needs

    def must_wait(self, cluster: str) -> bool:
        return self.flow.must_wait(cluster)

    async def wait(self, hold: Hold) -> Waited:
        return await self.flow.wait(hold)

    def answered(self, cluster: str, address: str, status: int) -> bool:
        """The picked pod's answer began with ``status``; True (and a warning) when that
        ejected it."""
        if not self.picker.answered(cluster, address, status):
            return False
        pod = self.picker.pools[cluster].pods[address]
        log.warning("picker_pod_ejected", cluster=cluster, endpoint=address, status=status,
                    seconds=round(pod.ejected_until - self._clock(), 1))
        return True

    def follow(self, config: RoutingConfig) -> None:
        """Adopt a reloaded ``config`` (the config reloader calls this on the event loop; the
        picker first: it owns the pools). The config in force again is a no-op."""
        if config is self._config:
            return
        self._config = config
        self.picker.update(config)
        self.scraper.update(config)

    async def start(self) -> None:
        await self.scraper.start()

    async def stop(self) -> None:
        await self.scraper.stop()
