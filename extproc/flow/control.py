"""Flow control on the event loop: the waiting line of each pool of this process, released as
pods get room (docs: Flow control).

A request whose pool has no pod with room (or has requests waiting already) becomes a
:class:`~extproc.actions.Hold`; :meth:`FlowControl.wait` queues it and returns when it is
released (picked, there and then) or refused. Releases happen on :meth:`FlowControl.kick`, which
the picker runtime calls whenever room may have appeared: a request of the pool ended, or a pod
of it was scraped. A client that hangs up while waiting cancels the wait: it leaves the queue,
nothing was sent, nothing reserved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from extproc.actions import Hold, Waited
from extproc.flow.metrics import FlowMetrics
from extproc.flow.queue import BANDS, FlowQueue, Ticket
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.flow")


@dataclass(eq=False)
class _Waiter:
    hold: Hold
    future: asyncio.Future[Waited]
    started: float
    timer: asyncio.TimerHandle | None = None


class FlowControl:
    """The queues of this process, one per pool that has had a request wait.

    ``room(cluster)``: can a pod of ``cluster`` start one more request now (the picker's
    :meth:`~extproc.picker.pick.EndpointPicker.has_room`). ``clock``: the event loop's.
    """

    def __init__(self, room: Callable[[str], bool], metrics: FlowMetrics,
                 clock: Callable[[], float]) -> None:
        self._room = room
        self._metrics = metrics
        self._clock = clock
        self._queues: dict[str, FlowQueue[_Waiter]] = {}

    def must_wait(self, cluster: str) -> bool:
        """Does a request for ``cluster`` wait? When no pod has room, or others wait already
        (it takes its turn behind them: the queue decides who goes first)."""
        queue = self._queues.get(cluster)
        return bool(queue) or not self._room(cluster)

    def depth(self, cluster: str) -> int:
        queue = self._queues.get(cluster)
        return len(queue) if queue is not None else 0

    async def wait(self, hold: Hold) -> Waited:
        """Queue ``hold`` and wait until it is released or refused. Cancelled (the client hung
        up), it leaves the queue."""
        loop = asyncio.get_running_loop()
        queue = self._queues.get(hold.cluster)
        if queue is None:
            queue = self._queues[hold.cluster] = FlowQueue(hold.max_queue, hold.max_bytes,
                                                           hold.fairness)
        else:  # a reload may have changed the bounds
            queue.max_queue, queue.max_bytes, queue.fairness = \
                hold.max_queue, hold.max_bytes, hold.fairness
        waiter = _Waiter(hold, loop.create_future(), self._clock())
        ticket = Ticket(BANDS.index(hold.priority), hold.tenant, hold.size, waiter)
        for refused in queue.add(ticket):
            self._refuse(refused, "max_queue")
        future = waiter.future
        if not future.done():
            waiter.timer = loop.call_later(hold.max_wait_s, self._expire, queue, ticket)
            future.add_done_callback(lambda done: self._cancelled(queue, ticket, done))
            self.kick(hold.cluster)
        self._gauge(hold.cluster, queue)
        return await future

    def kick(self, cluster: str) -> None:
        """Release waiting requests of ``cluster`` while a pod has room: the first band with
        any waiting, tenants in turn."""
        queue = self._queues.get(cluster)
        if not queue:
            return
        while queue and self._room(cluster):
            ticket = queue.pop()
            if ticket is None:
                break
            if ticket.item.future.done():
                # Cancelled, its callback not run yet (callbacks run on the next loop turn):
                # its client is gone, so nothing is picked for it.
                self._metrics.abandoned(cluster, ticket.item.hold.priority)
                continue
            self._release(ticket)
        self._gauge(cluster, queue)

    def _leaving(self, waiter: _Waiter) -> float:
        """``waiter`` leaves the queue: its ``max_wait`` timer stopped; the seconds it waited."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        return self._clock() - waiter.started

    def _release(self, ticket: Ticket[_Waiter]) -> None:
        waiter = ticket.item
        waited = self._leaving(waiter)
        hold = waiter.hold
        try:
            pods = hold.pick()
        except Exception:  # a fault in the pick must not strand the request
            log.exception("extproc_internal_error", where="flow release", cluster=hold.cluster)
            pods = ()
        self._metrics.waited(hold.cluster, hold.priority, waited)
        waiter.future.set_result(Waited(pods, waited))

    def _refuse(self, ticket: Ticket[_Waiter], reason: str) -> None:
        waiter = ticket.item
        waited = self._leaving(waiter)
        hold = waiter.hold
        self._metrics.rejected(hold.cluster, hold.priority, reason, waited)
        if not waiter.future.done():
            waiter.future.set_result(Waited(None, waited, reason))

    def _expire(self, queue: FlowQueue[_Waiter], ticket: Ticket[_Waiter]) -> None:
        """``max_wait`` passed with the request still waiting."""
        if queue.remove(ticket):
            self._refuse(ticket, "max_wait")
            self._gauge(ticket.item.hold.cluster, queue)

    def _cancelled(self, queue: FlowQueue[_Waiter], ticket: Ticket[_Waiter],
                   future: asyncio.Future[Waited]) -> None:
        """The wait was cancelled (its client hung up): out of the queue, its timer stopped."""
        if not future.cancelled():
            return
        waiter = ticket.item
        if waiter.timer is not None:
            waiter.timer.cancel()
        if queue.remove(ticket):
            self._metrics.abandoned(waiter.hold.cluster, waiter.hold.priority)
            self._gauge(waiter.hold.cluster, queue)

    def _gauge(self, cluster: str, queue: FlowQueue[_Waiter]) -> None:
        for band, name in enumerate(BANDS):
            self._metrics.depth(cluster, name, queue.depth(band))
