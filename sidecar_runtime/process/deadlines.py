"""Per-call deadlines that share one timer: what ``asyncio.timeout`` does for one call, for less
CPU when many calls run with the same timeout.

``asyncio.timeout`` arms a timer per call (a ``TimerHandle`` made, scheduled and cancelled)
and costs ~4 µs a call on the event loop (a rate-limit decision is ~50 µs of Python,
bench.ratelimit_python). Calls with the same timeout end their deadlines in the order they
started, so they queue here in that order behind one timer, armed for the earliest deadline
still pending: a call adds itself to the queue and marks itself done, and only the timer's
firing walks the queue (dropping the calls done, cancelling the ones past their deadline, arming
for the next). A call past its deadline is cancelled exactly as ``asyncio.timeout`` cancels it
(``Task.cancel`` when its timer fires; the cancellation becomes ``TimeoutError`` unless
another cancellation was requested meanwhile).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_PENDING, _EXPIRING, _DONE = 0, 1, 2


class Deadline:
    """One call's deadline (:meth:`Deadlines.start`), ended by :meth:`Deadlines.finish`."""

    __slots__ = ("cancelling", "state", "task", "when")

    def __init__(self, when: float, task: asyncio.Task[object], cancelling: int) -> None:
        self.when = when
        self.task: asyncio.Task[object] | None = task  # None once done: not kept alive by it
        self.cancelling = cancelling
        self.state = _PENDING


class _Queue:
    __slots__ = ("armed", "entries", "timeout_s", "timer")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.entries: deque[Deadline] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.armed = 0.0


class Deadlines:
    """The deadlines of calls made on one event loop (meeting another loop starts afresh)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[float, _Queue] = {}

    async def run(self, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """``await call()``, or ``TimeoutError`` once ``timeout_s`` have passed: as
        ``async with asyncio.timeout(timeout_s): return await call()``."""
        deadline = self.start(timeout_s)
        try:
            result = await call()
        except BaseException as exc:
            if self.finish(deadline, isinstance(exc, asyncio.CancelledError)):
                raise TimeoutError from exc
            raise
        self.finish(deadline, False)
        return result

    def start(self, timeout_s: float) -> Deadline:
        """The current task's deadline, ``timeout_s`` from now; end it with :meth:`finish`
        however the call ends."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            for old in self._queues.values():
                if old.timer is not None:
                    old.timer.cancel()
            self._loop, self._queues = loop, {}
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a deadline needs a task")
        deadline = Deadline(loop.time() + timeout_s, task, task.cancelling())
        queue = self._queues.get(timeout_s)
        if queue is None:
            queue = self._queues[timeout_s] = _Queue(timeout_s)
        queue.entries.append(deadline)
        if queue.timer is None:
            queue.armed = deadline.when
            queue.timer = loop.call_at(deadline.when, self._fire, queue)
        return deadline

    @staticmethod
    def finish(deadline: Deadline, cancelled: bool) -> bool:
        """End ``deadline``; ``cancelled``: the call ended in ``CancelledError``. True when that
        cancellation was the deadline's (the caller raises ``TimeoutError``), as
        ``asyncio.timeout`` decides it."""
        expiring = deadline.state == _EXPIRING
        deadline.state = _DONE
        task, deadline.task = deadline.task, None
        if not expiring or task is None:
            return False
        return task.uncancel() <= deadline.cancelling and cancelled

    def _fire(self, queue: _Queue) -> None:
        loop = self._loop
        assert loop is not None
        queue.timer = None
        # The deadline the timer was armed for has come, whatever the clock says (a timer may
        # fire a little early, as asyncio.timeout's own may), and so have those not after it.
        due = max(loop.time(), queue.armed)
        entries = queue.entries
        while entries:
            head = entries[0]
            if head.state == _DONE:
                entries.popleft()
            elif head.when <= due:
                entries.popleft()
                head.state = _EXPIRING
                if head.task is not None:
                    head.task.cancel()
            else:
                queue.armed = head.when
                queue.timer = loop.call_at(head.when, self._fire, queue)
                return
        if self._queues.get(queue.timeout_s) is queue:  # none pending: a timeout seen once
            del self._queues[queue.timeout_s]          # does not stay
