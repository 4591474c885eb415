"""``--workers N``: one service as N processes sharing its gRPC port, under one supervisor.

grpc.aio runs one event loop on one core, so one process cannot use more. With N workers the
supervisor (the process you started) starts N copies of the service, each binding the same
``host:port`` with SO_REUSEPORT: the kernel spreads Envoy's connections over them. Each worker
serves its own ``/metrics`` and ``/healthz`` on a private Unix socket; the supervisor owns the
metrics port and answers ``/metrics`` with the workers' numbers merged
(:mod:`sidecar_runtime.process.metrics_merge`), ``/healthz`` with 200 only while every worker is healthy.

- SIGTERM or SIGINT: the supervisor's ``/healthz`` turns 503 and every worker gets SIGTERM and
  drains as a single process does (gRPC health NOT_SERVING, streams in flight get
  ``LLM_SIDECAR_SHUTDOWN_GRACE_S``); exit 0 when every worker exited 0, else 1.
- A worker that dies after it became healthy is restarted (its counters are kept in the sums,
  as last read: the supervisor reads every worker's ``/metrics`` every 5 s on its own);
  a restart that fails is tried again, 1 s later, then 2, 4... up to 30 s, the other workers
  serving meanwhile. A worker started while the routing YAML is refused serves the last config
  that loaded (kept in the supervisor's folder). Before every worker first became healthy, one
  that dies (a crash at start-up would loop) stops everything: exit 1.
- A worker whose ``/healthz`` does not answer within 3 s three times in a row (asked every
  2 s; its event loop stuck) is killed, and restarted as above: the kernel would go on giving
  it connections.
- If the supervisor is killed outright, the kernel sends each worker SIGTERM
  (``PR_SET_PDEATHSIG``): they drain on their own.

Workers are told they are workers by the hidden ``--worker-ops-socket`` flag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar_runtime.process.grpc_listen import listening
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.metrics_merge import Scrape, exposition, merge
from sidecar_runtime.process.procs import Child, start
from sidecar_runtime.process.signals import install_stop_handlers
from sidecar_runtime.wire.names import UNIX_PREFIX

log = get_logger("sidecar_runtime.process.workers")
READY_TIMEOUT_S = 120.0
"""How long a worker may take to answer ``/healthz`` (a loaded 2-core machine is slow)."""
PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 3.0
PROBE_MISSES = 3
"""Probes of a serving worker's ``/healthz`` in a row that may go unanswered before it is
killed as hung."""
METRICS_REFRESH_S = 5.0
"""How often the supervisor reads every worker's ``/metrics`` on its own, besides each scrape
of its own: a worker that dies loses at most this much of its counts."""
RESTART_BACKOFF_S = (1.0, 30.0)
"""A failed restart is tried again after the first, doubling up to the second."""
SCRAPE_TIMEOUT_S = 5.0
KILL_MARGIN_S = 10.0
"""After the grace period, how long the supervisor still waits before SIGKILL."""
LAST_GOOD_CONFIG = "last-good-config.yaml"
"""In the supervisor's folder: the copy of the last config file a worker loaded, which a
restarted worker serves while the file is refused (:class:`sidecar_runtime.process.reload.Reloader`)."""

WorkerCommand = Callable[[int, str], list[str]]
"""(worker index, its ops socket path) → the command that runs the worker."""
TextPage = Callable[[Mapping[str, str], str], str]
"""(query, merged metrics text) → a plain-text page (extproc's ``/canary``)."""


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=int, default=None,
        help="processes serving the gRPC port together (SO_REUSEPORT), one core each; "
             "default LLM_SIDECAR_WORKERS, else 1")
    parser.add_argument("--worker-ops-socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)


def workers_problem(service: str, workers: int, host: str, port: int,
                    needs_shared_store: bool) -> str | None:
    """Why ``--workers`` cannot be used this way, or None. ``needs_shared_store``: the service
    keeps state that must be one across workers and has no Redis to keep it in."""
    if workers < 1:
        return f"{service}: --workers must be 1 or more, not {workers}"
    if workers == 1:
        return None
    if host.startswith(UNIX_PREFIX):
        return (f"{service}: --workers {workers} needs a host:port to listen on; a Unix socket "
                f"({host}) cannot be shared by several processes (listen on TCP, or run one "
                "worker)")
    if port == 0:
        return f"{service}: --workers {workers} needs a fixed --port (0 would give each worker " \
               "its own)"
    if needs_shared_store:
        return (f"{service}: --workers {workers} needs LLM_SIDECAR_REDIS_URL: with in-process "
                f"buckets each worker would keep its own, and every limit would be {workers} "
                "times too loose")
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``. Checked before the workers start:
    with SO_REUSEPORT they would otherwise silently share the port with a forgotten instance
    of the same user instead of failing. Only a listener counts: a connection that holds the
    port as its source port, or in TIME_WAIT, lets go of it, and the workers wait for that
    (:func:`sidecar_runtime.process.grpc_listen.add_port`)."""
    return listening(host, port)


class _Worker:
    def __init__(self, index: int, socket_path: str) -> None:
        self.index = index
        self.socket_path = socket_path
        self.child: Child | None = None
        self.ready = False
        self.last_text: str | None = None
        self.misses = 0
        """Health probes in a row it did not answer (see :data:`PROBE_MISSES`)."""

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()


class Supervisor:
    """Runs ``count`` workers and the merged ops HTTP server until stopped."""

    def __init__(self, service: str, count: int, command: WorkerCommand, ops_host: str,
                 ops_port: int, grace_s: float,
                 text_pages: Mapping[str, TextPage] | None = None) -> None:
        self.service = service
        self._command = command
        self._ops = (ops_host, ops_port)
        self._grace_s = grace_s
        self._pages = dict(text_pages or {})
        self._dir = tempfile.mkdtemp(prefix=f"llm-sidecar-{service}-")
        self._workers = [_Worker(i, os.path.join(self._dir, f"worker-{i}.sock"))
                         for i in range(count)]
        self._retired: list[str] = []
        self._stopping = False
        self._stop = asyncio.Event()
        self._failed: str | None = None
        self.registry = CollectorRegistry()
        self._restarts = Counter("llm_sidecar_worker_restarts",
                                 "Workers that died after they were serving and were restarted.",
                                 ["service"], registry=self.registry)
        self._alive = Gauge("llm_sidecar_workers", "Worker processes by state (configured|ready).",
                            ["service", "state"], registry=self.registry)
        self._restarts.labels(service)
        self._alive.labels(service, "configured").set(count)
        self._alive.labels(service, "ready").set_function(
            lambda: sum(w.ready and w.alive() for w in self._workers))

    # -- workers ------------------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(worker.socket_path)
        worker.ready = False
        worker.misses = 0
        worker.child = start(f"{self.service} worker {worker.index}",
                             self._command(worker.index, worker.socket_path))

    async def _get(self, worker: _Worker, path: str,
                   timeout_s: float = SCRAPE_TIMEOUT_S) -> tuple[int, str]:
        connector = aiohttp.UnixConnector(path=worker.socket_path)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
                session.get(f"http://worker{path}") as resp:
            return resp.status, await resp.text()

    async def _wait_ready(self, worker: _Worker) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if not worker.alive():
                code = worker.child.process.returncode if worker.child else None
                raise RuntimeError(f"{self.service} worker {worker.index} exited with code "
                                   f"{code} before it was serving")
            with contextlib.suppress(OSError, aiohttp.ClientError, asyncio.TimeoutError):
                if (await self._get(worker, "/healthz"))[0] == 200:
                    worker.ready = True
                    return
            await asyncio.sleep(0.1)
        if not self._stop.is_set():
            raise RuntimeError(f"{self.service} worker {worker.index} was not serving after "
                               f"{READY_TIMEOUT_S:.0f}s")

    async def _restart(self, worker: _Worker) -> None:
        code = worker.child.process.returncode if worker.child else None
        log.error("worker_died", service=self.service, worker=worker.index, code=code,
                  action="restarting it")
        if worker.last_text is not None:  # its counts stay in the sums, folded into one text
            self._retired = [exposition(merge(
                [Scrape(text, live=False) for text in (*self._retired, worker.last_text)]
            )).decode()]
            worker.last_text = None
        self._restarts.labels(self.service).inc()
        backoff = RESTART_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                self._spawn(worker)  # a fork can fail too (ENOMEM, EAGAIN): tried again
                await self._wait_ready(worker)
                return
            except (RuntimeError, OSError) as exc:
                log.error("worker_restart_failed", service=self.service, worker=worker.index,
                          error=str(exc), action=f"trying again in {backoff:g}s")
            _kill(worker)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def _probe(self, worker: _Worker) -> None:
        """One health probe of a serving worker; the third miss in a row kills it (the watch
        loop then restarts it)."""
        try:
            status, _ = await self._get(worker, "/healthz", PROBE_TIMEOUT_S)
        except (TimeoutError, OSError, aiohttp.ClientError):
            status = 0
        if status == 200 or not worker.ready or self._stopping:
            worker.misses = 0
            return
        worker.misses += 1
        if worker.misses >= PROBE_MISSES and worker.alive():
            log.error("worker_hung", service=self.service, worker=worker.index,
                      misses=worker.misses, action="killing it; it is restarted")
            _kill(worker)

    async def _watch(self, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task[None]] = set()

        def run(coro: Awaitable[None]) -> asyncio.Task[None]:
            task = asyncio.ensure_future(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return task
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        next_refresh = time.monotonic() + METRICS_REFRESH_S
        probing: dict[int, asyncio.Task[None]] = {}
        while not stop.is_set() and self._failed is None:
            for worker in self._workers:
                if worker.ready and not worker.alive():
                    worker.ready = False  # restarting: not probed, not counted healthy
                    run(self._restart(worker))
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + PROBE_INTERVAL_S
                for worker in self._workers:
                    busy = probing.get(worker.index)
                    if worker.ready and worker.alive() and (busy is None or busy.done()):
                        probing[worker.index] = run(self._probe(worker))
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + METRICS_REFRESH_S
                run(self._refresh())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self) -> bool:
        """SIGTERM to every worker, wait for them; True when every one exited 0."""
        self._stopping = True
        children = [w.child for w in self._workers if w.child is not None]
        for child in children:
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(_wait_exits, children, self._grace_s + KILL_MARGIN_S)
        clean = True
        for child in children:
            if child.alive():
                log.error("worker_killed", service=self.service, worker=child.name,
                          detail="still running after the grace period")
                child.process.kill()
            code = child.process.wait()
            clean = clean and code == 0
        return clean

    # -- ops HTTP -----------------------------------------------------------------------

    async def _refresh(self) -> None:
        """Every live worker's ``/metrics`` read into ``last_text``."""
        async def scrape(worker: _Worker) -> None:
            child = worker.child
            with contextlib.suppress(OSError, aiohttp.ClientError, asyncio.TimeoutError):
                status, text = await self._get(worker, "/metrics")
                # Not if the worker was replaced meanwhile: the dead one's numbers, retired
                # already, would be counted twice, then lost to the new one's first scrape.
                if status == 200 and worker.child is child:
                    worker.last_text = text
        await asyncio.gather(*(scrape(w) for w in self._workers if w.alive()))

    async def metrics_text(self) -> str:
        await self._refresh()
        # A worker that did not answer this time counts with its last numbers (a sum that
        # dips for one scrape would read as a counter reset).
        scrapes = [Scrape(text, live=False) for text in self._retired]
        scrapes += [Scrape(w.last_text) for w in self._workers if w.last_text is not None]
        own = generate_latest(self.registry).decode()
        families = merge(scrapes) + list(text_string_to_metric_families(own))
        return exposition(families).decode()

    def healthy(self) -> bool:
        return not self._stopping and all(w.ready and w.alive() and w.misses < PROBE_MISSES
                                          for w in self._workers)

    async def _start_ops(self) -> web.AppRunner:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=await self.metrics_text(),
                                content_type="text/plain", charset="utf-8",
                                headers={"x-llm-sidecar-workers": str(len(self._workers))})

        async def healthz(_: web.Request) -> web.Response:
            ok = self.healthy()
            return web.json_response({"status": "ok" if ok else "unavailable",
                                      "workers_ready": sum(w.ready and w.alive()
                                                           for w in self._workers),
                                      "workers": len(self._workers)},
                                     status=200 if ok else 503)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        for path, produce in self._pages.items():
            app.router.add_get(path, self._page(produce))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, *self._ops, reuse_address=True).start()
        return runner

    def _page(self, produce: TextPage) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def page(request: web.Request) -> web.Response:
            try:
                text = produce(request.query, await self.metrics_text())
            except ValueError as exc:
                return web.Response(status=400, text=f"{exc}\n")
            return web.Response(text=text + "\n")
        return page

    # -- the whole life -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Start the workers and the ops server, serve until ``stop``, drain; the exit code."""
        self._stop = stop
        runner: web.AppRunner | None = None
        clean = False
        try:
            try:
                for worker in self._workers:
                    self._spawn(worker)
                await asyncio.gather(*(self._wait_ready(w) for w in self._workers))
                runner = await self._start_ops()
            except (RuntimeError, OSError) as exc:
                self._failed = str(exc)
            if self._failed is None:
                log.info("workers_serving", service=self.service, workers=len(self._workers),
                         metrics=f"{self._ops[0]}:{self._ops[1]}")
                await self._watch(stop)
            if self._failed is not None:
                log.error("workers_failed", service=self.service, error=self._failed,
                          action="stopping every worker")
            log.info("workers_draining", service=self.service, grace_s=self._grace_s)
            clean = await self._drain()
        finally:
            if runner is not None:
                await runner.cleanup()
            shutil.rmtree(self._dir, ignore_errors=True)
        log.info("workers_stopped", service=self.service, clean=clean)
        return 0 if clean and self._failed is None else 1


def worker_file(worker_dir: str | None, name: str) -> str | None:
    """``name`` in the folder a supervisor's workers share (None outside ``--workers``)."""
    return None if worker_dir is None else os.path.join(worker_dir, name)


def _kill(worker: _Worker) -> None:
    if worker.child is not None and worker.child.alive():
        worker.child.process.kill()


def _wait_exits(children: list[Child], timeout_s: float) -> None:
    """Until every child exited, or ``timeout_s`` passed (blocking: run it in a thread)."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(0.0, deadline - time.monotonic()))


def supervise(service: str, count: int, command: WorkerCommand, listen: tuple[str, int],
              ops: tuple[str, int], grace_s: float,
              text_pages: Mapping[str, TextPage] | None = None) -> int:
    """Run :class:`Supervisor` on its own event loop until SIGTERM/SIGINT; the exit code
    (2 when ``listen``, the workers' shared gRPC address, is taken already)."""
    if port_in_use(*listen):
        print(f"{service}: {listen[0]}:{listen[1]} is in use already (another {service}?)",
              file=sys.stderr)
        return 2
    ops_host, ops_port = ops

    async def main() -> int:
        stop = asyncio.Event()
        install_stop_handlers(stop)
        return await Supervisor(service, count, command, ops_host, ops_port, grace_s,
                                text_pages).run(stop)
    return asyncio.run(main())
