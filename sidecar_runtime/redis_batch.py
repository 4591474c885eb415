"""Redis commands issued in the same event-loop iteration go to Redis as one pipeline.

Under load, many rate-limit decisions are in flight at once, and redis-py sends each on its own
pooled connection: one ``send``, one wake-up and one ``recv`` per command, on every connection.
On this project's machines a loopback syscall costs as much as the script itself, so the
commands that callers issue while the loop runs one batch of callbacks are gathered and sent on
one connection as a non-transactional pipeline (one write, the replies read back in order).
A lone command waits one loop iteration (a ``sleep(0)``) and goes as a plain command.

Nothing else changes for a caller: :meth:`CommandBatcher.execute` returns the reply or raises
what redis-py would (a reply error such as ``NoScriptError`` only for its own command; a
connection error or timeout for every command of the batch). A caller that gives up (its
deadline cancels it) leaves the batch alone: its command may still run, as with redis-py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

MAX_BATCH = 128
"""Commands per pipeline: a larger burst goes out as several."""
MAX_IN_FLIGHT = 32
"""Pipelines in flight at once (each holds one pooled connection while it runs)."""

_Pending = tuple[tuple[Any, ...], "asyncio.Future[Any]"]


class CommandBatcher:
    """Gathers the commands of one loop iteration into a pipeline on ``client``.

    The first command of an iteration leads: it yields once (``sleep(0)``) so that the
    commands issued meanwhile can join, then sends alone (a plain command: a lone command costs
    one loop iteration and nothing more) or, with company, sends them all as one pipeline in a
    task of its own, so that a leader whose caller gives up does not strand the others."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._queue: list[_Pending] | None = None  # the batch forming in this iteration
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._running: set[asyncio.Task[None]] = set()

    async def execute(self, *command: Any) -> Any:
        queue = self._queue
        if queue is not None and len(queue) < MAX_BATCH - 1:  # the leader is the last one
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            queue.append((command, future))
            return await future
        joined: list[_Pending] = []
        self._queue = joined
        try:
            await asyncio.sleep(0)
        except BaseException:  # the leader's caller gave up: the others still go
            if self._queue is joined:
                self._queue = None
            if joined:
                self._spawn(joined)
            raise
        if self._queue is joined:
            self._queue = None
        if not joined:
            return await self._client.execute_command(*command)
        own: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._spawn([(command, own), *joined])
        return await own

    def _spawn(self, batch: list[_Pending]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            async with self._slots:
                live = [(command, future) for command, future in batch if not future.done()]
                if not live:
                    return
                pipe = self._client.pipeline(transaction=False)
                for command, _ in live:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), reply in zip(live, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def aclose(self) -> None:
        """Wait for the pipelines in flight (their callers are waiting for them)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
