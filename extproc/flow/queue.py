"""The waiting line of one pool in one extproc process: three priority bands, tenants in turn
within a band, bounded in requests and bytes (docs: Flow control). Pure data: no clock, no
event loop; :mod:`extproc.flow.control` decides when to take the next one."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

Fairness = Literal["tenant", "none"]
BANDS = ("high", "medium", "low")
"""The bands, served in this order: one is served only while those before it are empty."""

T = TypeVar("T")


@dataclass(eq=False)
class Ticket(Generic[T]):
    """One waiting request: its band (an index of :data:`BANDS`), tenant, body size, arrival
    order, and what the caller keeps with it (``item``)."""

    band: int
    tenant: str
    size: int
    item: T
    seq: int = field(default=0)
    turn: int = field(default=0)
    """Its turn in its band (:class:`_Band`)."""
    key: str = field(default="")
    """The line it waits in (its tenant, or one line for all): kept, so a reload that changes
    ``fairness`` still finds it."""


class _Band(Generic[T]):
    """One band: a line per tenant (one line for every tenant without fairness), the lines
    served in turn by start-time fair queueing, one request a turn.

    Each request gets a turn number when it joins: the next after its tenant's last request
    (waiting, or served in the current turn), and never earlier than the turn being served
    (``_now``). The lowest turn goes next (ties: first come). So a tenant with 100 waiting holds
    turns ``now`` to ``now + 99`` and a tenant with none waiting joins at ``now``: it goes before
    the flooding tenant's next request, as plain rotation would only after it, yet it cannot
    take two turns while another tenant waits for one (its second request joins a turn later).
    """

    def __init__(self) -> None:
        self.lines: dict[str, deque[Ticket[T]]] = {}
        self.count = 0
        self.bytes = 0
        self._now = 0
        """The turn of the request served last."""
        self._served_now: dict[str, int] = {}
        """Tenants with none waiting that were served in turn :attr:`_now` (their next request
        joins a turn later); every other tenant without a line joins at :attr:`_now`."""
        self._heads: list[tuple[int, int, str]] = []
        """(turn, arrival, tenant) of each line's first request; entries of a line whose first
        request changed since are stale and skipped."""

    def push(self, ticket: Ticket[T], key: str) -> None:
        ticket.key = key
        line = self.lines.get(key)
        if line is None:
            line = self.lines[key] = deque()
            served = self._served_now.pop(key, None)
            ticket.turn = self._now if served is None else served + 1
            heapq.heappush(self._heads, (ticket.turn, ticket.seq, key))
        else:
            ticket.turn = line[-1].turn + 1
        line.append(ticket)
        self.count += 1
        self.bytes += ticket.size

    def pop(self) -> Ticket[T]:
        while True:
            _, seq, key = heapq.heappop(self._heads)
            line = self.lines.get(key)
            if line and line[0].seq == seq:
                break
        ticket = line.popleft()
        if ticket.turn > self._now:
            self._now = ticket.turn
            self._served_now.clear()  # their next request joins at the new turn anyway
        if line:
            heapq.heappush(self._heads, (line[0].turn, line[0].seq, key))
        else:
            del self.lines[key]
            self._served_now[key] = ticket.turn
        self.count -= 1
        self.bytes -= ticket.size
        return ticket

    def newest(self) -> Ticket[T]:
        return max((line[-1] for line in self.lines.values()), key=lambda t: t.seq)

    def remove(self, ticket: Ticket[T]) -> bool:
        key = ticket.key
        line = self.lines.get(key)
        if line is None:
            return False
        first = line[0] is ticket
        try:
            line.remove(ticket)
        except ValueError:
            return False
        if not line:
            del self.lines[key]
        elif first:
            heapq.heappush(self._heads, (line[0].turn, line[0].seq, key))
        if len(self._heads) > 2 * len(self.lines) + 64:  # mostly stale: rebuilt
            self._heads = [(line[0].turn, line[0].seq, k) for k, line in self.lines.items()]
            heapq.heapify(self._heads)
        self.count -= 1
        self.bytes -= ticket.size
        return True


class FlowQueue(Generic[T]):
    """Requests waiting for a pod of one pool.

    :meth:`add` takes a request, refusing the newest of the lowest band waiting (which may be
    the new one; with tenant fairness, of its tenant with the most waiting) while over
    ``max_queue`` requests or ``max_bytes`` of bodies; :meth:`pop` gives
    the next to serve: the first band with any waiting, and in it the tenant whose turn it is
    (``fairness: tenant``: in turn, one request a turn, :class:`_Band`) or the oldest
    (``none``).
    """

    def __init__(self, max_queue: int, max_bytes: int, fairness: Fairness) -> None:
        self.max_queue = max_queue
        self.max_bytes = max_bytes
        self.fairness: Fairness = fairness
        self._bands: tuple[_Band[T], ...] = (_Band(), _Band(), _Band())
        self._seq = 0

    def __len__(self) -> int:
        return sum(band.count for band in self._bands)

    @property
    def bytes(self) -> int:
        """Body bytes waiting."""
        return sum(band.bytes for band in self._bands)

    def depth(self, band: int) -> int:
        return self._bands[band].count

    def _key(self, ticket: Ticket[T]) -> str:
        return ticket.tenant if self.fairness == "tenant" else ""

    def add(self, ticket: Ticket[T]) -> list[Ticket[T]]:
        """Queue ``ticket``; returns the requests refused to make room (:meth:`_victim`; only
        ``ticket`` itself when it is the one to refuse, or alone larger than ``max_bytes``):
        they have left the queue."""
        self._seq += 1
        ticket.seq = self._seq
        if ticket.size > self.max_bytes:
            return [ticket]
        self._bands[ticket.band].push(ticket, self._key(ticket))
        refused: list[Ticket[T]] = []
        while len(self) > self.max_queue or self.bytes > self.max_bytes:
            victim = self._victim()
            self.remove(victim)
            if victim is ticket:
                # Refused itself: those it displaced come back (each was the newest of its
                # line, so appending puts it back in its place); nobody goes for nothing.
                for back in reversed(refused):
                    self._bands[back.band].push(back, back.key)
                return [ticket]
            refused.append(victim)
        return refused

    def _victim(self) -> Ticket[T]:
        """The request a full queue refuses: the newest of the lowest band waiting; with
        ``fairness: tenant`` the newest of that band's tenant with the most waiting, so a
        tenant that floods the queue loses its own newest, not another tenant's first."""
        band = next(b for b in reversed(self._bands) if b.count)
        if self.fairness != "tenant":
            return band.newest()
        line = max(band.lines.values(), key=lambda line: (len(line), line[-1].seq))
        return line[-1]

    def pop(self) -> Ticket[T] | None:
        """The next request to serve, taken out of the queue; None when none waits."""
        for band in self._bands:
            if band.count:
                return band.pop()
        return None

    def remove(self, ticket: Ticket[T]) -> bool:
        """Take ``ticket`` out (its client left, its wait ran out, or it is refused); False if
        not queued."""
        return self._bands[ticket.band].remove(ticket)
