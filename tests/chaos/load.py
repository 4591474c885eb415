"""Background HTTP load for the chaos tests: a few virtual users in their own thread send
requests through Envoy and record every outcome, so a test can break something mid-run and then
read what clients saw before, during and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass(frozen=True)
class Call:
    kind: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Record:
    kind: str
    started: float
    """``time.monotonic()`` when sent."""
    latency: float
    status: int
    """HTTP status; 0 when the request got no complete answer (reset, timeout)."""
    code: str | None
    """The OpenAI error ``code`` of an error body."""
    headers: dict[str, str] = field(default_factory=dict)


def error_code(body: bytes) -> str | None:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "not_json"
    error = doc.get("error") if isinstance(doc, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else None


async def send(session: aiohttp.ClientSession, base_url: str, call: Call,
               timeout_s: float) -> Record:
    started = time.monotonic()
    try:
        async with session.post(f"{base_url}{call.path}", data=call.body,
                                headers={"content-type": "application/json", **call.headers},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.read()
            code = error_code(body) if resp.status >= 400 else None
            kept = {k.lower(): v for k, v in resp.headers.items()
                    if k.lower().startswith(("x-llm-", "x-ratelimit", "content-type"))}
            return Record(call.kind, started, time.monotonic() - started, resp.status, code, kept)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Record(call.kind, started, time.monotonic() - started, 0, type(exc).__name__)


class Load:
    """``users`` loops, each sending ``make_call(n)`` back to back (or paced to ``rate_per_s``
    in total) until stopped. Use as a context manager."""

    def __init__(self, base_url: str, make_call: Callable[[int], Call], users: int = 4,
                 rate_per_s: float | None = None, timeout_s: float = 15.0) -> None:
        self.base_url = base_url
        self.make_call = make_call
        self.users = users
        self.rate_per_s = rate_per_s
        self.timeout_s = timeout_s
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counter = 0

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True,
                                        name="chaos-load")
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)
            assert not self._thread.is_alive(), "the load generator did not stop"

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.users * 2, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self._user(session) for _ in range(self.users)))

    async def _user(self, session: aiohttp.ClientSession) -> None:
        interval = self.users / self.rate_per_s if self.rate_per_s else 0.0
        next_at = time.monotonic()
        while not self._stop.is_set():
            n = self._counter
            self._counter += 1
            self.records.append(await send(session, self.base_url, self.make_call(n),
                                           self.timeout_s))
            if interval:
                next_at += interval
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def between(self, start: float, end: float) -> list[Record]:
        return [r for r in list(self.records) if start <= r.started < end]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t:`` leaves ``[start, end]`` monotonic times in ``t``."""
    marks = [time.monotonic()]
    try:
        yield marks
    finally:
        marks.append(time.monotonic())
