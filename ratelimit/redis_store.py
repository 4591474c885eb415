"""Buckets in Redis (standalone or Cluster), decided by one Lua script per round trip.

Standalone: the whole request is one ``EVALSHA`` (``NOSCRIPT`` falls back to ``EVAL``, which
also caches the script), so it is atomic and all or nothing.

Cluster: every bucket key carries its own hash tag (``keys.py``), so a request's buckets
usually live in different slots. The hits are grouped per slot, the groups run concurrently,
and if any group denies the request, the groups that admitted are refunded with a second
script. The small race: between a charge and its refund, another request may see those tokens
missing and be denied. Debt charges are never refunded. Every command goes through
:class:`~sidecar_runtime.redis.cluster.ClusterRouter`: a master that is down fails its keys at once
(:class:`NodeDownError`, before any group is charged), the other masters keep deciding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from ratelimit.bucket import BucketResult, BucketSpec, Hit, Settle
from ratelimit.errors import BackendError, NodeDown
from ratelimit.lua import DECIDE, DECIDE_SHA, REFUND, REFUND_SHA, SETTLE, SETTLE_SHA
from ratelimit.store import LEASE_TTL_S, StoreResult
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.redis.batch import CommandBatcher
from sidecar_runtime.redis.client import MAX_CONNECTIONS, Client
from sidecar_runtime.redis.cluster import ClusterRouter, NodeDownError

_SCRIPTS = (DECIDE, SETTLE, REFUND)

log = get_logger("ratelimit.redis_store")

_DEBT, _SHADOW, _CONCURRENT = 1, 2, 4
_RELEASE = "-1"


def marker_key(bucket: str, lease: str) -> str:
    """Where a token bucket remembers one lease's reservation: the bucket's own hash tag comes
    first, so the marker lives in the bucket's Cluster slot."""
    return f"{bucket}:lease:{lease}"


def _reserves(hit: Hit) -> bool:
    return hit.lease is not None and not hit.spec.concurrent and not hit.spec.debt and hit.hits > 0


class _Group(NamedTuple):
    """Hits of one slot: their positions in the request, the distinct keys (buckets, then
    reservation markers), and per position the ``KEYS`` index of its bucket and of its marker
    ("0": none) as the scripts read them, made once per call for the decision and a refund."""

    positions: tuple[int, ...]
    keys: tuple[str, ...]
    refs: tuple[tuple[str, str], ...]


MAX_SPEC_TEXTS = 4096
"""Bucket specs whose script arguments a store remembers (one per limit a matched descriptor
uses, so a few hundred; above the bound it starts afresh)."""


class RedisStore:
    def __init__(self, client: Client, margin_s: float = 1.0, lease_ttl_s: float = LEASE_TTL_S) -> None:
        self._client = client
        self._margin_ms = str(max(1, round(margin_s * 1000)))
        self._lease_ttl_ms = str(max(1, round(lease_ttl_s * 1000)))
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._router = ClusterRouter(client) if isinstance(client, RedisCluster) else None
        self._batcher = CommandBatcher(client) if isinstance(client, Redis) else None
        self._undoing: set[asyncio.Task[None]] = set()
        """Refunds of decisions that came back after their deadline (:meth:`_undo_late`)."""
        self._orphans: set[asyncio.Task[Any]] = set()
        """Cluster decisions still running after their caller gave up (:meth:`_eval`)."""
        self._spec_texts: dict[int, tuple[BucketSpec, str, str, str]] = {}
        """id(spec) -> (spec, capacity, rate, flags) as the scripts read them: the spec objects
        of matched descriptors are kept by the Limiter and come back on every call, and
        ``repr`` of two floats and the flags cost ~0.7 µs per bucket. The spec is held, so
        its id stays its own while remembered."""

    @property
    def client(self) -> Client:
        return self._client

    async def connect(self) -> None:
        """Open the connections and load the scripts: a fresh replica's first decision would
        otherwise pay TCP, TLS, AUTH and a ``NOSCRIPT`` round trip inside its 50 ms deadline
        (3 to 10 ms on an idle machine over TLS, more on a busy one), and get ``on_backend_error``
        after every start."""
        with _backend_errors():
            if self._router is not None:
                # At once: a connection per script on each master, for a request whose
                # buckets are on several slots of one master (one script call per slot).
                await asyncio.gather(*(self._router.on_every_master("SCRIPT", "LOAD", script)
                                       for script in _SCRIPTS))
                return
            assert self._batcher is not None
            await asyncio.gather(*(self._batcher.execute("SCRIPT", "LOAD", script)
                                   for script in _SCRIPTS))

    async def decide(self, hits: Sequence[Hit]) -> StoreResult:
        if not hits:
            return StoreResult(True, ())
        with _backend_errors():
            return await self._decide(hits)

    async def settle(self, settles: Sequence[Settle]) -> None:
        if not settles:
            return
        if not isinstance(self._client, RedisCluster):  # one group: no gather, no extra task
            with _backend_errors():
                await self._settle_group(settles)
            return
        by_slot: dict[int, list[Settle]] = {}
        for item in settles:
            by_slot.setdefault(self._client.keyslot(item.key), []).append(item)
        with _backend_errors():
            await asyncio.gather(*(self._settle_group(items) for items in by_slot.values()))

    async def _settle_group(self, items: Sequence[Settle]) -> None:
        keys: dict[str, int] = {}
        args: list[str] = [self._margin_ms, str(len(items))]
        for item in items:
            k = keys.setdefault(item.key, len(keys) + 1)
            if item.used is None:
                used, mark = _RELEASE, 0
            else:
                used, mark = str(item.used), keys.setdefault(marker_key(item.key, item.lease), len(keys) + 1)
            _, capacity, rate, _ = self._spec_text(item.spec)
            args += [str(k), capacity, rate, used, str(mark), item.lease]
        await self._eval(SETTLE_SHA, SETTLE, tuple(keys), args)

    async def aclose(self) -> None:
        for task in list(self._orphans):  # their replies would find no connection to come on
            task.cancel()
        await asyncio.gather(*self._orphans, return_exceptions=True)
        if self._router is not None:
            await self._router.aclose()
        if self._batcher is not None:
            await self._batcher.aclose()
        await self._client.aclose()

    async def _decide(self, hits: Sequence[Hit]) -> StoreResult:
        if self._router is not None:
            await self._router.check(hit.key for hit in hits)
        groups = self._groups(hits)
        if len(groups) == 1:  # its positions are 0, 1, ... in order
            admitted, results = await self._run(hits, groups[0])
            return StoreResult(admitted, tuple(results))
        outcomes = await asyncio.gather(*(self._run(hits, group) for group in groups),
                                        return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        merged: dict[int, BucketResult] = {}
        for group, outcome in zip(groups, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                merged.update(zip(group.positions, outcome[1], strict=True))
        admitted = failed is None and all(not isinstance(o, BaseException) and o[0]
                                          for o in outcomes)
        if not admitted:
            # A group refused, or one failed (its master down, its deadline gone) while the
            # others admitted: what they admitted is taken back, the request being answered
            # without them (refused, or by on_backend_error).
            charged = [g for g, o in zip(groups, outcomes, strict=True)
                       if not isinstance(o, BaseException) and o[0]]
            refunds = await asyncio.gather(*(self._refund(hits, group, merged)
                                             for group in charged), return_exceptions=failed is not None)
            if failed is not None:
                if any(isinstance(r, BaseException) for r in refunds):
                    log.warning("ratelimit_partial_decision_not_undone",
                                detail="its slots free themselves when their lease expires")
                raise failed
            for group in charged:
                for i in group.positions:
                    merged[i] = _refunded(hits[i], merged[i])
        return StoreResult(admitted, tuple(merged[i] for i in range(len(hits))))

    def _groups(self, hits: Sequence[Hit]) -> list[_Group]:
        if self._router is None:  # a standalone Redis (isinstance of a generic class costs)
            return [_group(hits, tuple(range(len(hits))))]
        client = self._client
        assert isinstance(client, RedisCluster)
        by_slot: dict[int, list[int]] = {}
        for index, hit in enumerate(hits):
            by_slot.setdefault(client.keyslot(hit.key), []).append(index)
        return [_group(hits, tuple(positions)) for positions in by_slot.values()]

    def _spec_text(self, spec: BucketSpec) -> tuple[BucketSpec, str, str, str]:
        found = self._spec_texts.get(id(spec))
        if found is None or found[0] is not spec:
            if len(self._spec_texts) >= MAX_SPEC_TEXTS:
                self._spec_texts.clear()
            found = self._spec_texts[id(spec)] = (spec, repr(spec.capacity), repr(spec.rate),
                                                  str(_flags(spec)))
        return found

    async def _run(self, hits: Sequence[Hit], group: _Group) -> tuple[bool, list[BucketResult]]:
        """Decide one group; its results in the order of its positions."""
        args: list[str] = [self._margin_ms, str(len(group.positions)), self._lease_ttl_ms]
        for i, (key_ref, marker_ref) in zip(group.positions, group.refs, strict=True):
            hit = hits[i]
            _, capacity, rate, flags = self._spec_text(hit.spec)
            args += [key_ref, capacity, rate, flags, str(hit.hits), marker_ref, hit.lease or ""]
        reply = await self._eval(DECIDE_SHA, DECIDE, group.keys, args,
                                 late=partial(self._undo_late, hits, group))
        results = [BucketResult(int(reply[1 + 2 * n]) == 1, float(reply[2 + 2 * n]))
                   for n in range(len(group.positions))]
        return int(reply[0]) == 1, results

    def _undo_late(self, hits: Sequence[Hit], group: _Group, reply: Any) -> None:
        """The reply of a decision whose deadline passed: the request was answered without it
        (``on_backend_error``), but the script ran when Redis came back. What it admitted is
        taken back (its slots, its charges), or a slot would stay taken for its lease's 10
        minutes with no request behind it, and a refused request would have paid."""
        if isinstance(reply, Exception) or int(reply[0]) != 1:
            return
        results = {i: BucketResult(int(reply[1 + 2 * n]) == 1, float(reply[2 + 2 * n]))
                   for n, i in enumerate(group.positions)}
        task = asyncio.get_running_loop().create_task(self._refund(hits, group, results))
        self._undoing.add(task)
        task.add_done_callback(self._undone)

    def _undone(self, task: asyncio.Task[None]) -> None:
        self._undoing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("ratelimit_late_decision_not_undone", error=str(task.exception()),
                        detail="its slots free themselves when their lease expires")

    async def _refund(self, hits: Sequence[Hit], group: _Group, results: dict[int, BucketResult]) -> None:
        refundable = [
            (i, refs) for i, refs in zip(group.positions, group.refs, strict=True)
            if results[i].admitted and not hits[i].spec.debt and hits[i].hits > 0
        ]
        if not refundable:
            return
        args: list[str] = [self._margin_ms, str(len(refundable))]
        for i, (key_ref, marker_ref) in refundable:
            hit = hits[i]
            _, capacity, rate, flags = self._spec_text(hit.spec)
            args += [key_ref, capacity, rate, str(hit.hits), flags, marker_ref, hit.lease or ""]
        await self._eval(REFUND_SHA, REFUND, group.keys, args)

    async def _eval(self, sha: str, script: str, keys: Sequence[str], args: list[str],
                    late: Callable[[Any], None] | None = None) -> Any:
        """``late``: given the reply (or the error) of a script whose caller gave up after it
        was sent."""
        if self._router is None:  # the batcher keeps its own bound (a burst waits there)
            return await self._eval_once(sha, script, keys, args, late)
        # At most MAX_CONNECTIONS commands in flight: redis-py refuses a command when its pool
        # is exhausted rather than waiting (a burst of 150 calls turned into backend errors).
        if late is None:
            async with self._slots:
                return await self._evalsha(sha, script, keys, args)
        # On a Cluster the command runs in a task of its own, which a caller that gives up
        # leaves running (redis-py would drop the connection, and the reply with it): its
        # reply goes to ``late``. The task keeps its place in the bound until Redis answers,
        # as the connection it holds does. (A caller that gives up before the command is
        # even sent, the slot map still loading, also gets it sent, then refunded: twice the
        # Redis work in an outage, for one code path.)
        await self._slots.acquire()
        try:
            task = asyncio.get_running_loop().create_task(self._evalsha(sha, script, keys, args))
        except BaseException:
            self._slots.release()
            raise
        task.add_done_callback(lambda _: self._slots.release())
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(partial(_hand_late, late))
            raise

    async def _eval_once(self, sha: str, script: str, keys: Sequence[str], args: list[str],
                         late: Callable[[Any], None] | None = None) -> Any:
        try:
            return await self._evalsha(sha, script, keys, args, late)
        except RedisConnectionError:
            # The connection dropped under the command (Redis restarted, or closed it just
            # before the command was written): the batcher fails every command in flight on
            # it at once, and one more try opens a fresh one, within the same deadline.
            # Without this a restart cost each command in flight a backend error (a 503
            # under on_backend_error: deny). The price: if a connection dies after Redis ran
            # the script but before the reply arrived, that decision is charged twice.
            return await self._evalsha(sha, script, keys, args)

    async def _evalsha(self, sha: str, script: str, keys: Sequence[str], args: list[str],
                       late: Callable[[Any], None] | None = None) -> Any:
        try:
            return await self._command(keys[0], "EVALSHA", sha, len(keys), *keys, *args,
                                       late=late)
        except NoScriptError:
            return await self._command(keys[0], "EVAL", script, len(keys), *keys, *args,
                                       late=late)

    async def _command(self, key: str, *command: Any,
                       late: Callable[[Any], None] | None = None) -> Any:
        """Every command of the store is sent here: on a Cluster through the router, to the
        master of ``key``'s slot (the router also retries a connection found dead)."""
        if self._router is not None:
            return await self._router.execute(key, *command)
        # One standalone Redis: our own pipelined connections, one write per loop iteration.
        assert self._batcher is not None
        return await self._batcher.execute(*command, late=late)


def _hand_late(late: Callable[[Any], None], task: asyncio.Task[Any]) -> None:
    """The outcome of a command its caller gave up on, to ``late``: the reply, or the error."""
    if task.cancelled():
        return
    error = task.exception()
    late(error if error is not None else task.result())


@contextmanager
def _backend_errors() -> Iterator[None]:
    """Redis's errors as the store's: a master known down (its keys fail at once, the breaker
    untouched), or any other failure."""
    try:
        yield
    except NodeDownError as exc:
        raise NodeDown(f"redis: {exc}") from exc
    except (RedisError, RedisClusterException, OSError) as exc:
        raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc


def _flags(spec: BucketSpec) -> int:
    return ((_DEBT if spec.debt else 0) | (_SHADOW if spec.shadow else 0)
            | (_CONCURRENT if spec.concurrent else 0))


def _group(hits: Sequence[Hit], positions: tuple[int, ...]) -> _Group:
    keys: dict[str, int] = {}
    for i in positions:
        key = hits[i].key
        if key not in keys:
            keys[key] = len(keys) + 1
    refs: list[tuple[str, str]] = []
    for i in positions:
        hit = hits[i]
        lease = hit.lease
        marker = "0"
        if lease is not None and _reserves(hit):
            mark = marker_key(hit.key, lease)
            index = keys.get(mark)
            if index is None:
                index = keys[mark] = len(keys) + 1
            if lease:  # an empty lease: its marker unused (but its key sent, as ever)
                marker = _index_text(index)
        refs.append((_index_text(keys[hit.key]), marker))
    return _Group(positions, tuple(keys), tuple(refs))


_INDEXES = tuple(str(n) for n in range(64))
"""``KEYS`` indexes as the scripts read them, made once."""


def _index_text(index: int) -> str:
    return _INDEXES[index] if index < len(_INDEXES) else str(index)


def _refunded(hit: Hit, result: BucketResult) -> BucketResult:
    """The result an admitted-then-refunded hit reports: its charge given back."""
    if not result.admitted or hit.spec.debt:
        return result
    return BucketResult(True, min(hit.spec.capacity, result.level + hit.hits))
