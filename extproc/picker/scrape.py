"""Keep each picker pool's :class:`~extproc.picker.state.PoolState` current: its pods' addresses
(DNS re-resolved) and each pod's engine metrics (and DCGM's, when configured).

One task per pod scrapes it on its own schedule, so a slow or dead pod delays nobody else, and
requests never wait for a scrape: they read whatever the last one left in the PoolState. All of
it runs on the event loop's thread (the PoolState has no locks).

Choices, and why:

- **Timeout** of one scrape: ``min(1 s, max(250 ms, interval))``. vLLM serves ``/metrics`` on the
  same event loop as its streams, so a busy pod can take a few hundred ms to answer; a tighter
  timeout would blind the picker to exactly the pods whose load matters. Past 1 s the numbers
  are too old to steer by. Connecting gets half of it, so that a pod whose packets are dropped
  shows as a connect failure (:func:`connect_failed`), not as a slow answer.
- **Unreachable**: a scrape that could not connect (refused, connect timeout) is told apart from
  one that connected and failed (HTTP error, bad body, slow answer): Envoy pays a failed connect
  only for the former (``PodState.unreachable``, which the pick avoids).
- **Schedule**: every ``interval`` from the start of the previous scrape (a pod's scrapes never
  overlap), each pod starting at a random point of the first interval so that 64 pods are not
  scraped in one burst.
- **Backoff**: a failing pod is retried after ``interval x 2^(failures-1)``, at most
  ``max(interval, 2 s)``, with +-20% jitter: a dead pod costs one connection attempt every
  2 s, and a recovered one is seen again within 2 s.
- **One aiohttp session** for every pod (keep-alive; idle connections closed after 4 s, before
  uvicorn's default 5 s keep-alive can close one under a request); ``Accept-Encoding:
  identity`` so that neither vLLM's event loop nor ours spends CPU on gzip; no redirects; no
  proxy from the environment; the body is read up to :data:`MAX_BODY_BYTES` and refused past it.
- **DNS**: names are resolved every ``resolve_interval`` with the system resolver, like Envoy's
  ``V4_PREFERRED`` (the rendered clusters' lookup family): the IPv4 addresses if any, else the
  IPv6 ones, each with the endpoint's port, so the picker names the hosts Envoy has. A failed
  resolution keeps the name's last addresses. IP literals are used as they are.
- **DCGM** (``dcgm_url``) is scraped every ``max(interval, 1 s)``: dcgm-exporter itself
  refreshes every few seconds (30 s by default), so more often would only cost. Its reading is
  joined to the pod's next vLLM scrape; a failing DCGM leaves the GPU fields unknown (None)
  without failing the pod.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from extproc.picker.engines import Dialect, parse_pod
from extproc.picker.parse import MAX_BODY_BYTES, GpuReading, MetricsError, parse_dcgm
from extproc.picker.state import PoolState
from routing.schema import ClusterSpec, RoutingConfig
from routing.units import join_hostport, parse_hostport
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.picker.scrape")

Resolve = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port)`` → the ``ip:port`` addresses of a DNS name (raises ``OSError`` on failure)."""

BACKOFF_CAP_S = 2.0
DCGM_MIN_INTERVAL_S = 1.0
KEEPALIVE_S = 4.0
_CHUNK = 64 * 1024
_FETCH_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, MetricsError)


def scrape_timeout_s(interval_s: float) -> float:
    return min(1.0, max(0.25, interval_s))


def connect_failed(exc: BaseException) -> bool:
    """Whether a scrape failed before a connection was made: refused, unroutable, or the connect
    timeout (packets dropped). A pod that accepted the connection is reachable, whatever it
    answered."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def backoff_s(interval_s: float, failures: int, jitter: float = 1.0) -> float:
    """Delay before the next scrape of a pod that failed ``failures`` times in a row."""
    doubled: float = interval_s * 2.0 ** min(failures - 1, 30)
    return min(max(interval_s, BACKOFF_CAP_S), doubled) * jitter


def _ip_literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


async def resolve_system(host: str, port: int) -> list[str]:
    """The system resolver, IPv4 preferred (Envoy's ``V4_PREFERRED``), sorted and deduplicated."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    v4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({str(info[4][0]).split("%")[0] for info in infos if info[0] == socket.AF_INET6})
    return [join_hostport(ip, port) for ip in (v4 or v6)]


@dataclass(frozen=True)
class PoolPlan:
    """What the scraper does for one picker pool (from its ``ClusterSpec``)."""

    cluster: str
    endpoints: tuple[str, ...]
    metrics_path: str
    interval_s: float
    resolve_s: float
    stale_s: float
    dcgm_url: str | None
    dialect: Dialect | None = None
    """The configured load series (``endpoint_picker.metrics``); None: recognised by name."""

    @classmethod
    def of(cls, cluster: str, spec: ClusterSpec) -> PoolPlan | None:
        picker = spec.endpoint_picker
        if picker is None:
            return None
        names = picker.metrics
        dialect = None if names is None else Dialect.named(names.queue, names.running,
                                                           names.kv_cache)
        return cls(cluster, tuple(spec.endpoints), picker.metrics_path, picker.interval_s,
                   picker.resolve_s, picker.stale_s, picker.dcgm_url, dialect)

    def dcgm_for(self, pod: str) -> str | None:
        if self.dcgm_url is None:
            return None
        host, _, port = pod.rpartition(":")  # keeps [v6] brackets, as a URL needs them
        return self.dcgm_url.replace("{host}", host).replace("{port}", port)


def plans(config: RoutingConfig) -> dict[str, PoolPlan]:
    found = {name: PoolPlan.of(name, spec) for name, spec in config.clusters.items()}
    return {name: plan for name, plan in found.items() if plan is not None}


class Scraper:
    """Scrapes the pods of every pool with ``endpoint_picker`` in the current config.

    ``pools`` is the picker's ``dict[str, PoolState]``: the scraper keeps its keys exactly the
    picker clusters of the current config (adding a PoolState for a new one, dropping a removed
    one) and writes addresses and metrics into them. ``clock`` gives the time stamped on each
    scrape; it must be the one the picker judges freshness with (default: the event loop's
    ``time()``). ``resolve`` replaces the system resolver (tests).
    """

    def __init__(self, pools: dict[str, PoolState], config: RoutingConfig, *,
                 clock: Callable[[], float] | None = None, resolve: Resolve | None = None,
                 on_scrape: Callable[[str], None] | None = None) -> None:
        self._pools = pools
        self._on_scrape = on_scrape
        """Told the cluster after each good scrape of one of its pods (flow control releases
        waiting requests into the room it shows)."""
        self._clock = clock
        self._resolve = resolve or resolve_system
        self._plans: dict[str, PoolPlan] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool_tasks: dict[str, asyncio.Task[None]] = {}
        self._pod_tasks: dict[str, dict[str, list[asyncio.Task[None]]]] = {}
        self._resolved: dict[tuple[str, int], list[str]] = {}
        """Last good resolution of each DNS name (host, port): kept when one fails."""
        self._gpu: dict[tuple[str, str], GpuReading] = {}
        self.update(config)

    @property
    def running(self) -> bool:
        return self._session is not None

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        """Its live tasks (a resolver per pool with DNS names; a scraper, and a DCGM one, per
        pod): none after :meth:`stop`."""
        return tuple(self._tasks)

    async def start(self) -> None:
        """Start scraping (on the event loop that will run it). Returns at once."""
        if self._session is not None:
            return
        if self._clock is None:
            self._clock = asyncio.get_running_loop().time
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers={"Accept-Encoding": "identity", "User-Agent": "llm-sidecar-picker"},
            trust_env=False)
        for plan in self._plans.values():
            self._start_pool(plan)

    async def stop(self) -> None:
        """Cancel every task, wait for them, close the session. The PoolStates stay as they are."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool_tasks.clear()
        self._pod_tasks.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def update(self, config: RoutingConfig) -> None:
        """Follow a reloaded config: pools added, removed or changed (endpoints, intervals,
        path, DCGM URL, metric names) restart their scraping; unchanged ones carry on untouched. Call it on
        the event loop's thread; an unchanged config is a no-op."""
        new = plans(config)
        for cluster, old in list(self._plans.items()):
            if new.get(cluster) != old:
                self._stop_pool(cluster)
                if cluster not in new:
                    self._pools.pop(cluster, None)
        changed = [plan for cluster, plan in new.items() if self._plans.get(cluster) != plan]
        self._plans = new
        wanted = {parse_hostport(e) for plan in new.values() for e in plan.endpoints}
        self._resolved = {k: v for k, v in self._resolved.items() if k in wanted}
        for plan in changed:
            pool = self._pools.get(plan.cluster)
            if pool is None:
                self._pools[plan.cluster] = PoolState(plan.cluster, plan.stale_s)
            else:
                pool.stale_s = plan.stale_s
            if self._session is not None:
                self._start_pool(plan)

    # -- pools ------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_pool(self, plan: PoolPlan) -> None:
        self._pod_tasks[plan.cluster] = {}
        if any(_ip_literal(parse_hostport(e)[0]) is None for e in plan.endpoints):
            self._pool_tasks[plan.cluster] = self._spawn(
                self._resolve_loop(plan), f"picker-resolve-{plan.cluster}")
        # Literals (and names resolved before a reload) are known now: scraping starts at once.
        self._set_addresses(plan, self._known_addresses(plan))

    def _stop_pool(self, cluster: str) -> None:
        task = self._pool_tasks.pop(cluster, None)
        if task is not None:
            task.cancel()
        for pod_tasks in self._pod_tasks.pop(cluster, {}).values():
            for pod_task in pod_tasks:
                pod_task.cancel()
        self._gpu = {k: v for k, v in self._gpu.items() if k[0] != cluster}

    def _known_addresses(self, plan: PoolPlan) -> list[str]:
        found: list[str] = []
        for endpoint in plan.endpoints:
            host, port = parse_hostport(endpoint)
            literal = _ip_literal(host)
            found.extend([join_hostport(literal, port)] if literal is not None
                         else self._resolved.get((host, port), []))
        return list(dict.fromkeys(found))  # two names may share a pod: once, in first order

    async def _resolve_loop(self, plan: PoolPlan) -> None:
        names = [(h, p) for h, p in map(parse_hostport, plan.endpoints) if _ip_literal(h) is None]
        failing: set[tuple[str, int]] = set()  # logged when a name starts failing, not each time
        while True:
            results = await asyncio.gather(*(self._resolve(h, p) for h, p in names),
                                           return_exceptions=True)
            for name, result in zip(names, results, strict=True):
                if isinstance(result, BaseException) or not result:
                    if name not in failing:
                        failing.add(name)
                        log.warning("picker_resolve_failed", cluster=plan.cluster, host=name[0],
                                    error=repr(result) if result else "no addresses",
                                    kept=len(self._resolved.get(name, [])))
                else:
                    if name in failing:
                        failing.discard(name)
                        log.info("picker_resolve_recovered", cluster=plan.cluster, host=name[0])
                    self._resolved[name] = list(result)
            self._set_addresses(plan, self._known_addresses(plan))
            await asyncio.sleep(plan.resolve_s)

    def _set_addresses(self, plan: PoolPlan, addresses: list[str]) -> None:
        pool = self._pools.get(plan.cluster)
        if pool is not None:
            pool.set_addresses(addresses)
        pods = self._pod_tasks.setdefault(plan.cluster, {})
        for gone in pods.keys() - set(addresses):
            for task in pods.pop(gone):
                task.cancel()
            self._gpu.pop((plan.cluster, gone), None)
        for pod in addresses:
            if pod not in pods:
                pods[pod] = self._pod_tasks_for(plan, pod)

    def _pod_tasks_for(self, plan: PoolPlan, pod: str) -> list[asyncio.Task[None]]:
        tasks = [self._spawn(self._scrape_loop(plan, pod), f"picker-scrape-{pod}")]
        dcgm = plan.dcgm_for(pod)
        if dcgm is not None:
            tasks.append(self._spawn(self._dcgm_loop(plan, pod, dcgm), f"picker-dcgm-{pod}"))
        return tasks

    # -- pods -------------------------------------------------------------------------------

    async def _fetch(self, url: str, timeout_s: float) -> str:
        """The body at ``url``. A cancel always ends it as a cancel: the loops catch every
        ``Exception`` as a failed scrape, so a cancel that the HTTP stack below turned into an
        error of its own would leave a loop running, and :meth:`stop` waiting for it (seen
        once in CI: a scrape loop cancelled while a fetch failed kept running, and ``stop``
        never returned)."""
        try:
            return await self._get(url, timeout_s)
        except Exception:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None
            raise

    async def _get(self, url: str, timeout_s: float) -> str:
        session = self._session
        if session is None:
            raise MetricsError("scraper stopped")
        # The connect timeout under the total: a pod that drops SYNs raises
        # ConnectionTimeoutError (unreachable) rather than the total's plain TimeoutError.
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s / 2)
        async with session.get(url, timeout=timeout, allow_redirects=False) as response:
            if response.status != 200:
                raise MetricsError(f"HTTP {response.status}")
            if (response.content_length or 0) > MAX_BODY_BYTES:
                raise MetricsError(f"metrics body over {MAX_BODY_BYTES} bytes")
            body = bytearray()
            async for chunk in response.content.iter_chunked(_CHUNK):
                body += chunk
                if len(body) > MAX_BODY_BYTES:  # leaving the block drops the connection
                    raise MetricsError(f"metrics body over {MAX_BODY_BYTES} bytes")
        return body.decode("utf-8", "replace")

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def _scrape_loop(self, plan: PoolPlan, pod: str) -> None:
        loop = asyncio.get_running_loop()
        url = f"http://{pod}{plan.metrics_path}"
        timeout_s = scrape_timeout_s(plan.interval_s)
        failures = 0
        await asyncio.sleep(random.uniform(0, plan.interval_s))
        while True:
            started = loop.time()
            pool = self._pools.get(plan.cluster)
            try:
                metrics = parse_pod(await self._fetch(url, timeout_s), plan.dialect)
            except Exception as exc:  # any failure is a failed scrape; the loop lives on
                failures += 1
                if pool is not None:
                    pool.record_failure(pod, connect=connect_failed(exc))
                if failures == 1 or not isinstance(exc, _FETCH_ERRORS):
                    _log_failure("picker_scrape_failing", plan.cluster, pod, exc)
                await asyncio.sleep(backoff_s(plan.interval_s, failures, random.uniform(0.8, 1.2)))
                continue
            gpu = self._gpu.get((plan.cluster, pod))
            if gpu is not None:
                metrics = replace(metrics, gpu_temp_c=gpu.temp_c,
                                  gpu_mem_used_frac=gpu.mem_used_frac, throttled=gpu.throttled)
            if pool is not None:
                pool.record_scrape(pod, metrics, self._now())
                if self._on_scrape is not None:
                    try:
                        self._on_scrape(plan.cluster)
                    except Exception:  # the scraping must go on whatever a listener does
                        log.exception("extproc_internal_error", where="after scrape",
                                      cluster=plan.cluster)
            if failures:
                log.info("picker_scrape_recovered", cluster=plan.cluster, endpoint=pod,
                         failed=failures)
                failures = 0
            await asyncio.sleep(max(0.0, started + plan.interval_s - loop.time()))

    async def _dcgm_loop(self, plan: PoolPlan, pod: str, url: str) -> None:
        interval_s = max(plan.interval_s, DCGM_MIN_INTERVAL_S)
        failures = 0
        await asyncio.sleep(random.uniform(0, plan.interval_s))
        while True:
            try:
                self._gpu[(plan.cluster, pod)] = parse_dcgm(
                    await self._fetch(url, scrape_timeout_s(interval_s)))
            except Exception as exc:
                failures += 1
                self._gpu.pop((plan.cluster, pod), None)  # unknown, not the last reading
                if failures == 1 or not isinstance(exc, _FETCH_ERRORS):
                    _log_failure("picker_dcgm_failing", plan.cluster, pod, exc)
                await asyncio.sleep(backoff_s(interval_s, failures, random.uniform(0.8, 1.2)))
                continue
            failures = 0
            await asyncio.sleep(interval_s)


def _log_failure(event: str, cluster: str, pod: str, exc: Exception) -> None:
    """Once when a pod starts failing (and for every error nobody expected, as a bug): the
    cause, short. aiohttp's errors carry the address, never a secret (none is sent)."""
    cause = (str(exc) or type(exc).__name__)[:200]
    if isinstance(exc, _FETCH_ERRORS):
        log.warning(event, cluster=cluster, endpoint=pod, error=cause)
    else:
        log.error(event, cluster=cluster, endpoint=pod, error=cause, unexpected=repr(type(exc)))
