"""Commands to a Redis Cluster, sent straight to the master that owns each key's slot, with a
circuit per master: a dead master costs only the keys it owns, and its keys are served again
within a probe interval of it answering.

Every Redis call of the rate limiter's bucket store and of extproc's embedding cache goes
through :class:`ClusterRouter` when the URL is a Cluster. It uses redis-py's slot map and
per-node connection pools, not its command routing, because redis-py 8.1's routing turns one
dead master into an outage of the whole cluster (issue 18: the chaos test's master killed
twice for 2 s under load, with the default 50 ms deadline, 6 runs):

- every ``ConnectionError`` from one node (``RedisCluster._execute_command``) sets
  ``_initialize``, so the next command of *any* key reloads the topology inline, inside its own
  deadline (``CLUSTER SLOTS`` and ``COMMAND``, 5-55 ms measured): 27-91 reloads per run;
- every reload (``NodesManager.set_nodes``) marks every pooled connection of every node for
  reconnect, so commands on the healthy masters pay new connections too;
- a reload cancelled by the caller's deadline closes every connection of every node
  (``RedisCluster.initialize``'s ``except BaseException``), failing commands in flight on the
  healthy masters (0-9 times per run). Those misses opened the process-wide breaker in 5 of 6
  runs, and then every key got ``on_backend_error`` for a cooldown (116 of 117 probes in one
  outage), again whenever the half-open probe lost the same race (2 s after the master was
  writable once);
- ``CLUSTERDOWN`` (a restarted master's answer until its cluster state is ok) closes the whole
  client and sleeps 0.25 s inside the command (its source; the test sends no key there then).

With this router, the same 6 runs: one map load (at start-up), the breaker never opened, keys
on the live masters were enforced throughout, and enforcement was back 0-0.08 s after the
master was writable.

Here a node that refuses or drops connections (twice in a row: the first may be a connection
it closed when it restarted) or answers ``CLUSTERDOWN`` is marked down: commands for its slots
fail at once with :class:`NodeDownError`, and a background task asks it ``CLUSTER INFO`` every
``probe_interval_s`` until it says ``cluster_state:ok``. The slot map is re-read only when
something says it changed (a ``MOVED``, or every ``MAP_CHECK_INTERVAL_S`` while a node is down,
to follow a failover), off the request path, and loaded into redis-py only if it differs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, NodesManager, PipelineCommand, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from sidecar_runtime.compat.redis_internals import slot_owners
from sidecar_runtime.process.logs import get_logger

log = get_logger("llm_sidecar.redis")

PROBE_INTERVAL_S = 0.1
"""How often a down master is asked whether it is back: the bound on how long its keys wait
after it is writable again. One ``CLUSTER INFO`` per interval per down node."""
PROBE_TIMEOUT_S = 0.5
"""A probe or map check that takes longer counts as no answer (a frozen or unreachable node)."""
MAP_CHECK_INTERVAL_S = 1.0
"""While a master is down, how often the slot map is read from a live master: a replica
promoted in its place (after the cluster's node timeout) takes its keys from then on."""

Command = tuple[Any, ...]


class NodeDownError(RedisConnectionError):
    """A command for a master that is marked down (it failed, and has not answered a probe
    since). Nothing was sent, or the command that found it down failed."""

    def __init__(self, node: str, detail: str) -> None:
        super().__init__(f"redis cluster node {node} is down: {detail}")
        self.node = node


class ClusterRouter:
    """Routes commands of one :class:`RedisCluster` client; see the module docstring."""

    def __init__(self, client: RedisCluster, probe_interval_s: float = PROBE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._nodes: NodesManager = client.nodes_manager
        self._probe_interval_s = probe_interval_s
        self._clock = clock
        self._ready = False
        self._loading: asyncio.Task[None] | None = None
        self._down: dict[str, float] = {}
        """Node name -> when it was marked down."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._map_check: asyncio.Task[None] | None = None

    @property
    def down(self) -> frozenset[str]:
        """Names (``host:port``) of the masters marked down now."""
        return frozenset(self._down)

    async def ready(self) -> None:
        """Load the slot map once, in a task of its own that the callers wait for: a caller's
        deadline cancels its wait, not the load (a cancelled ``RedisCluster.initialize`` closes
        every connection, and the next caller starts over: at start-up with a 50 ms deadline
        that took three requests and opened the breaker). A load that failed is tried again
        by the next caller."""
        if self._ready:
            return
        if self._loading is None or self._loading.done():
            self._loading = self._spawn(self._load())
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        await self._client.initialize()
        self._ready = True

    def slot(self, key: str) -> int:
        return self._client.keyslot(key)

    def owner(self, key: str) -> ClusterNode:
        """The master of ``key``'s slot; :class:`NodeDownError` when it is marked down."""
        node = self._nodes.get_node_from_slot(self._client.keyslot(key))
        if node.name in self._down:
            raise NodeDownError(node.name, "waiting for it to answer again")
        return node

    async def check(self, keys: Iterable[str]) -> None:
        """Raise :class:`NodeDownError` if any key's master is down, before anything is sent
        (so a request that will get ``on_backend_error`` charges no bucket on the others)."""
        await self.ready()
        for key in keys:
            self.owner(key)

    async def execute(self, key: str, *args: Any) -> Any:
        """Run one command on the master of ``key`` (following one ``MOVED`` or ``ASK``)."""
        await self.ready()
        node = self.owner(key)
        try:
            try:
                return await self._send(node, args)
            except NodeDownError:
                raise
            except RedisConnectionError:
                # A pooled connection the node closed (it restarted): drop the idle ones and
                # try once more on a new one, within the caller's deadline. Refused again: it
                # is down. As on a standalone Redis, the price: a script whose reply was lost
                # with its connection runs twice.
                await _drop_idle(node)
                return await self._send(node, args)
        except ClusterDownError as exc:
            raise self._mark_down(node, exc) from exc
        except NodeDownError:
            raise
        except RedisConnectionError as exc:
            raise self._mark_down(node, exc) from exc

    async def on_every_master(self, *args: Any) -> list[Any]:
        """Run one command on every master of the slot map (``SCRIPT LOAD`` at start-up: it
        also opens a connection to each), in parallel; the replies in the map's order. A
        master that cannot be reached is marked down (its keys get ``on_backend_error`` at
        once, and it is probed) and its error raised once every master has answered."""
        await self.ready()
        masters = _owners(self._nodes)
        replies = await asyncio.gather(*(self._send(node, args) for node in masters),
                                       return_exceptions=True)
        errors = [self._mark_down(node, reply)
                  if isinstance(reply, (RedisConnectionError, ClusterDownError)) else reply
                  for node, reply in zip(masters, replies, strict=True)
                  if isinstance(reply, BaseException)]
        if errors:
            raise errors[0]  # every unreachable master marked down first, not only the first
        return list(replies)

    async def execute_many(self, commands: Sequence[tuple[str, Command]]) -> list[Any]:
        """Run ``(routing key, command)`` pairs: one pipeline per master, masters in parallel;
        the replies in order. Any master down: :class:`NodeDownError` before anything is sent."""
        await self.ready()
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, (key, _) in enumerate(commands):
            node = self.owner(key)
            by_node.setdefault(node.name, (node, []))[1].append(i)
        replies: list[Any] = [None] * len(commands)

        async def on(node: ClusterNode, positions: list[int]) -> None:
            batch = [commands[i] for i in positions]
            for i, reply in zip(positions, await self._pipeline(node, batch), strict=True):
                replies[i] = reply

        await asyncio.gather(*(on(node, positions) for node, positions in by_node.values()))
        return replies

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pipeline(self, node: ClusterNode, batch: list[tuple[str, Command]]) -> list[Any]:
        try:
            try:
                stack = await _pipe(node, [args for _, args in batch])
            except RedisConnectionError:
                await _drop_idle(node)  # as in execute(): maybe connections of a restarted node
                stack = await _pipe(node, [args for _, args in batch])
        except RedisConnectionError as exc:
            raise self._mark_down(node, exc) from exc
        replies: list[Any] = []
        for (key, args), command in zip(batch, stack, strict=True):
            result = command.result
            if isinstance(result, ClusterDownError):
                raise self._mark_down(node, result)
            if isinstance(result, AskError):  # MOVED or ASK: this one command again, redirected
                result = await self.execute(key, *args)
            elif isinstance(result, Exception):
                raise result
            replies.append(result)
        return replies

    async def _send(self, node: ClusterNode, args: Command) -> Any:
        try:
            return await node.execute_command(*args)
        except MovedError as exc:
            await self._nodes.move_slot(exc)
            self._check_map_soon()
            target = self._nodes.get_node_from_slot(exc.slot_id)
            if target.name in self._down:
                raise NodeDownError(target.name, "waiting for it to answer again") from exc
            try:
                return await target.execute_command(*args)
            except (RedisConnectionError, ClusterDownError) as failed:
                raise self._mark_down(target, failed) from failed
        except AskError as exc:  # the slot is migrating and this key has moved already
            asked = self._nodes.get_node(host=exc.host, port=exc.port)
            if asked is None or asked.name in self._down:
                self._check_map_soon()
                raise
            stack = await _pipe(asked, [("ASKING",), args])  # ASKING holds for one connection
            result = stack[1].result
            if isinstance(result, Exception):
                raise result from exc
            return result

    def _mark_down(self, node: ClusterNode, exc: Exception) -> NodeDownError:
        """Mark ``node`` down (once per outage) and start probing it; the error to raise."""
        if node.name not in self._down:
            self._down[node.name] = self._clock()
            log.warning("redis_cluster_node_down", node=node.name,
                        error=f"{type(exc).__name__}: {exc}",
                        detail="its keys get on_backend_error (the cache: bypass) until it "
                               f"answers; asking it every {self._probe_interval_s:g} s")
            self._spawn(self._probe(node))
            self._check_map_soon()
        return NodeDownError(node.name, f"{type(exc).__name__}: {exc}")

    async def _probe(self, node: ClusterNode) -> None:
        last_map_check = self._clock()
        try:
            while True:
                await asyncio.sleep(self._probe_interval_s)
                if await _cluster_ok(node):
                    log.info("redis_cluster_node_back", node=node.name,
                             down_s=round(self._clock() - self._down[node.name], 3))
                    return
                if self._clock() - last_map_check >= MAP_CHECK_INTERVAL_S:
                    last_map_check = self._clock()
                    await self._check_map()
                    if node.name not in {n.name for n in _owners(self._nodes)}:
                        log.info("redis_cluster_node_replaced", node=node.name,
                                 detail="its slots are served by another master now")
                        return
        finally:
            self._down.pop(node.name, None)

    def _check_map_soon(self) -> None:
        if self._map_check is None or self._map_check.done():
            self._map_check = self._spawn(self._check_map())

    async def _check_map(self) -> None:
        """Read ``CLUSTER SLOTS`` from a live master; reload redis-py's map if it differs."""
        for node in _owners(self._nodes):
            if node.name in self._down:
                continue
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    slots = await node.execute_command("CLUSTER SLOTS")
            except (RedisError, RedisClusterException, OSError, TimeoutError):
                continue
            if _differs(self._nodes, node, slots):
                log.info("redis_cluster_slot_map_changed", source=node.name)
                try:
                    await self._nodes.initialize()
                except (RedisError, RedisClusterException, OSError) as exc:
                    log.warning("redis_cluster_slot_map_reload_failed",
                                error=f"{type(exc).__name__}: {exc}")
            return

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self._tasks.discard)
        return task


def _settled(task: asyncio.Task[None]) -> None:
    """Retrieve a background task's error (its waiters got it; if all of them gave up first,
    asyncio would otherwise log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


async def _pipe(node: ClusterNode, commands: Sequence[Command]) -> list[PipelineCommand]:
    """Send ``commands`` on one connection of ``node``; each reply (or error) is in
    ``.result``. A connection error raises."""
    stack = [PipelineCommand(i, *args) for i, args in enumerate(commands)]
    await node.execute_pipeline(stack)
    for command in stack:
        if isinstance(command.result, RedisConnectionError):
            raise command.result
    return stack


async def _drop_idle(node: ClusterNode) -> None:
    """Close ``node``'s idle pooled connections and mark the busy ones to close when freed."""
    node.update_active_connections_for_reconnect()
    await node.disconnect_free_connections()


async def _cluster_ok(node: ClusterNode) -> bool:
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            info = await node.execute_command("CLUSTER INFO")
    except (RedisError, OSError, TimeoutError):
        return False
    return isinstance(info, dict) and _text(info.get("cluster_state")) == "ok"


def _owners(nodes: NodesManager) -> list[ClusterNode]:
    """The masters that own at least one slot in redis-py's current map."""
    seen: dict[str, ClusterNode] = {}
    for owners in slot_owners(nodes).values():
        if owners:
            seen.setdefault(owners[0].name, owners[0])
    return list(seen.values())


def _differs(nodes: NodesManager, source: ClusterNode, slots: Any) -> bool:
    """Does a ``CLUSTER SLOTS`` reply name another master for any slot than the map does?"""
    covered = 0
    for entry in slots:
        first, last, master = int(entry[0]), int(entry[1]), entry[2]
        host = _text(master[0]) or source.host
        host, port = nodes.remap_host_port(host, int(master[1]))
        name = f"{host}:{port}"
        for slot in range(first, last + 1):
            owners = slot_owners(nodes).get(slot)
            if not owners or owners[0].name != name:
                return True
        covered += last - first + 1
    return covered != len(slot_owners(nodes))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
