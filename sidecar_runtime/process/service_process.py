"""The one process skeleton of extproc and ratelimit: how a service starts, serves and drains.

A service supplies only what is its own (a :class:`Service`: its servicers, its resources, its
config :class:`~sidecar_runtime.process.reload.Reloader`, extra ops pages) and, for the command line, a
:class:`ServiceCommand` (its name, default address, config checks). The rest is here, once:

- :func:`run_service`, the CLI side: a worker of ``--workers N`` (hidden
  ``--worker-ops-socket``), the supervisor of N workers (:mod:`sidecar_runtime.process.workers`), or
  one process; the async side on uvloop, SIGINT/SIGTERM as a graceful stop.
- :class:`ServiceProcess`, the async side: the gRPC server (:mod:`sidecar_runtime.h2grpc`:
  grpc.aio's servicer API at about a fifth of its CPU per message), ``grpc.health.v1`` for ``""``
  and the service's name, the ops HTTP server (``/metrics``, ``/healthz``, extra pages; on a
  Unix socket for a worker), the reload task, and the one drain order (:meth:`ServiceProcess.stop`).

Log events are ``<name>_listening``, ``<name>_draining`` and ``<name>_stopped`` for both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import uvloop
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter, Gauge

from sidecar_runtime.h2grpc import Server
from sidecar_runtime.h2grpc.limits import Limits
from sidecar_runtime.process.grpc_listen import add_port, listen_address, metrics_host
from sidecar_runtime.process.heap import settle_heap
from sidecar_runtime.process.logs import bind_worker, get_logger
from sidecar_runtime.process.ops_http import bound_port, start_ops_server
from sidecar_runtime.process.procs import sidecar_command
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.signals import install_stop_handlers
from sidecar_runtime.process.workers import TextPage, supervise, workers_problem
from sidecar_runtime.redis.url import RedisUrlError, check_url

log = get_logger("sidecar_runtime.process.service_process")

OpsPage = Callable[[Mapping[str, str]], str]
"""query → a plain-text page of one process's ops HTTP server (extproc's ``/canary``)."""


class Service(Protocol):
    """What one service plugs into :class:`ServiceProcess`."""

    @property
    def name(self) -> str:
        """``extproc`` or ``ratelimit``: the prefix of the lifecycle's log events."""

    @property
    def health_name(self) -> str:
        """The gRPC service name ``grpc.health.v1`` reports (besides ``""``)."""

    @property
    def registry(self) -> CollectorRegistry:
        """What ``/metrics`` serves."""

    @property
    def reloader(self) -> Reloader[Any]:
        """The service's config; the skeleton runs its polling while the process serves."""

    @property
    def max_message_bytes(self) -> int:
        """The largest request message the service takes (a larger one: RESOURCE_EXHAUSTED)."""

    @property
    def ops_pages(self) -> Mapping[str, OpsPage]:
        """Extra plain-text pages of the ops HTTP server, by path."""

    async def open(self, server: Server) -> None:
        """Add the servicers to ``server`` (not started yet) and start the resources."""

    async def close(self) -> None:
        """Release the resources (after the server stopped: no call uses them any more)."""

    def describe(self) -> Mapping[str, Any]:
        """Extra fields of the ``<name>_listening`` log line."""


@dataclass(frozen=True)
class Listen:
    """Where a process listens. Ports given as 0 are chosen by the system."""

    host: str
    port: int
    metrics_port: int
    worker_ops_socket: str | None = None
    """Set: this process is one of ``--workers N``: the gRPC port is shared (SO_REUSEPORT) and
    ``/metrics`` and ``/healthz`` go to this Unix socket, for the supervisor."""


S = TypeVar("S", bound=Service)
Phase = Literal["new", "serving", "draining", "stopped"]


def grpc_server(name: str, max_message_bytes: int, settings: Settings,
                registry: CollectorRegistry) -> Server:
    """The service's gRPC server, its limits from ``settings``, with
    ``llm_sidecar_grpc_connections`` (open now) and
    ``llm_sidecar_grpc_connections_closed_total`` (ended by the server, by reason) in
    ``registry``."""
    closed = Counter("llm_sidecar_grpc_connections_closed",
                     "gRPC connections the server ended itself, by reason: an HTTP/2 error "
                     "code's name (enhance_your_calm: a flood or a limit passed), idle, "
                     "handshake_timeout, incomplete_timeout, too_many_connections.",
                     ["service", "reason"], registry=registry)
    server = Server(max_receive_message_length=max_message_bytes,
                    limits=Limits(max_connections=settings.grpc_max_connections),
                    on_close=lambda reason: closed.labels(name, reason).inc())
    Gauge("llm_sidecar_grpc_connections", "gRPC connections open (Envoy's, health checks').",
          ["service"], registry=registry).labels(name).set_function(lambda: server.connections)
    return server


class ServiceProcess(Generic[S]):
    """One service's gRPC and ops servers from start to drain, in-process (tests) or as the
    whole process (:func:`run_service`). ``port`` and ``metrics_port`` are the ones bound."""

    def __init__(self, service: S, listen: Listen, settings: Settings) -> None:
        self.service = service
        self._listen = listen
        self._settings = settings
        self.port = listen.port
        self.metrics_port = listen.metrics_port
        self._phase: Phase = "new"
        self._health = health_aio.HealthServicer()
        self._server: Server | None = None
        self._opened = False
        self._reload: asyncio.Task[None] | None = None
        self._ops: web.AppRunner | None = None

    @property
    def serving(self) -> bool:
        """What ``/healthz`` answers: True from start until the drain begins."""
        return self._phase == "serving"

    async def start(self) -> None:
        """Open the service, listen, report SERVING; a failure releases what was started."""
        if self._phase != "new":
            raise RuntimeError(f"{self.service.name}: started twice")
        listen, service = self._listen, self.service
        worker = listen.worker_ops_socket is not None
        try:
            server = grpc_server(service.name, service.max_message_bytes, self._settings,
                                 service.registry)
            self._server = server
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            self._opened = True  # a half-opened service is closed too
            await service.open(server)
            self.port = await add_port(server, listen.host, listen.port, self._settings,
                                       shared=worker)
            await server.start()
            for name in ("", service.health_name):
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._phase = "serving"
            self._reload = asyncio.create_task(service.reloader.run())
            # Last: a worker is ready once its /healthz answers 200, and gRPC serves by then.
            self._ops = await start_ops_server(
                metrics_host(listen.host), listen.metrics_port, service.registry,
                lambda: self.serving, dict(service.ops_pages), unix_path=listen.worker_ops_socket)
        except BaseException:
            await self._teardown(0.0)
            self._phase = "stopped"
            raise
        self.metrics_port = bound_port(self._ops, listen.metrics_port)
        metrics = listen.worker_ops_socket or f"{metrics_host(listen.host)}:{self.metrics_port}"
        log.info(f"{service.name}_listening", grpc=listen_address(listen.host, self.port),
                 tls=self._settings.grpc_tls_cert_file is not None, metrics=metrics,
                 **service.describe())

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (default grace: ``LLM_SIDECAR_SHUTDOWN_GRACE_S``); a second call does nothing.

        The order: ``/healthz`` 503 and gRPC health NOT_SERVING (Envoy's health checks take
        this replica out), the listener closes (Envoy opens new streams on another replica: its
        retry policy covers a refused connect) and calls in flight get up to the grace period
        (an SSE generation holds its ext_proc stream for the whole response), then the reload
        polling stops (a reload applied after ``close`` could restart a stopped resource: the
        endpoint picker's scrapers), the service's resources close, the ops server last.
        """
        if self._phase in ("draining", "stopped"):
            return
        grace = self._settings.shutdown_grace_s if grace_s is None else grace_s
        self._phase = "draining"
        log.info(f"{self.service.name}_draining", grace_s=grace)
        try:
            await self._teardown(grace)
        finally:
            self._phase = "stopped"
        log.info(f"{self.service.name}_stopped")

    async def _teardown(self, grace_s: float) -> None:
        await self._health.enter_graceful_shutdown()  # NOT_SERVING for every name
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._reload is not None:
            self._reload.cancel()
            await asyncio.gather(self._reload, return_exceptions=True)
            self._reload = None
        if self._opened:
            self._opened = False
            await self.service.close()
        if self._ops is not None:
            await self._ops.cleanup()
            self._ops = None

    async def run(self, stop: asyncio.Event) -> None:
        """:meth:`start`, serve until ``stop`` is set, :meth:`stop` (even if cancelled)."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await asyncio.shield(self.stop())


# -- the command line --------------------------------------------------------------------------


def _no_preflight(config_path: str, settings: Settings, workers: int) -> None:
    return None


@dataclass(frozen=True)
class ServiceCommand:
    """What differs between ``llm-sidecar extproc`` and ``llm-sidecar ratelimit``."""

    name: str
    default_address: Callable[[str], tuple[str, int]]
    """``--config`` → the gRPC ``(host, port)`` used where ``--host``/``--port`` are not given."""
    build: Callable[[str, Settings], Service]
    """``--config`` → the service (called on the event loop, before it listens)."""
    config_errors: tuple[type[Exception], ...]
    """What a bad config raises: printed as it is (``FILE:LINE: message``), exit 1 (as is a
    Redis URL no request could use, whatever the service)."""
    preflight: Callable[[str, Settings, int], None] = _no_preflight
    """Run by the supervisor before it starts the workers: a bad config gives one error,
    not N workers failing."""
    needs_shared_store: bool = False
    """Its state must be one across workers: ``--workers`` is refused without Redis."""
    supervisor_pages: Mapping[str, TextPage] = field(default_factory=dict)
    """Extra text pages of the supervisor's ops server, from the workers' merged metrics."""


def config_errors(command: ServiceCommand) -> tuple[type[Exception], ...]:
    """What stops ``command`` at start-up with one line and exit 1: its config errors, and a
    Redis URL no request could use."""
    return (RedisUrlError, *command.config_errors)


def run_service(command: ServiceCommand, args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM, then drain; the exit code: 0, 1 for a bad config (or a
    failed worker), 2 for a ``--workers`` refused."""
    if args.host is not None and args.port is not None:
        host, port = args.host, args.port  # a worker's: it may start on a file now refused
    else:
        try:
            host, port = command.default_address(args.config)
        except command.config_errors as exc:
            print(str(exc), file=sys.stderr)
            return 1
        host = args.host if args.host is not None else host
        port = args.port if args.port is not None else port
    if args.worker_ops_socket is not None:
        bind_worker(args.worker_index)
        # The supervisor's own folder: every worker keeps the last config that loaded there
        # (one restarted while the file is refused starts from it), and extproc's the canary
        # guards' verdicts (docs: Workers: one process per core).
        settings = settings.model_copy(
            update={"worker_dir": os.path.dirname(args.worker_ops_socket)})
    else:
        workers = args.workers if args.workers is not None else settings.workers
        if workers != 1:
            return _supervise(command, args, settings, workers, host, port)
    listen = Listen(host, port, args.metrics_port, args.worker_ops_socket)
    # uvloop: about 7 % less CPU per ext_proc stream and 5 % per rate-limit call than asyncio's
    # own loop (docs/decisions/0001-own-http2-server.md).
    return uvloop.run(_serve(command, args.config, listen, settings))


async def _serve(command: ServiceCommand, config_path: str, listen: Listen,
                 settings: Settings) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    try:
        process = ServiceProcess(command.build(config_path, settings), listen, settings)
        await process.start()
    except config_errors(command) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    settle_heap()  # what start-up built stays for the process's life: out of the collector's way
    try:
        await stop.wait()
    finally:
        await asyncio.shield(process.stop())
    return 0


def _supervise(command: ServiceCommand, args: argparse.Namespace, settings: Settings,
               workers: int, host: str, port: int) -> int:
    """``--workers N``: N processes on one port under a supervisor (sidecar_runtime.process.workers)."""
    needs_store = command.needs_shared_store and settings.redis_url is None
    problem = workers_problem(command.name, workers, host, port, needs_shared_store=needs_store)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        if settings.redis_url is not None:  # one line here, not one from every worker
            check_url(settings.redis_url.get_secret_value())
        command.preflight(args.config, settings, workers)
    except config_errors(command) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    base = [command.name, "--config", args.config, "--host", host, "--port", str(port)]
    return supervise(
        command.name, workers,
        lambda index, socket: sidecar_command(*base, "--worker-ops-socket", socket,
                                              "--worker-index", str(index)),
        (host, port), (metrics_host(host), args.metrics_port), settings.shutdown_grace_s,
        command.supervisor_pages)
