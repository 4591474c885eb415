"""The process skeleton both services run on, with a tiny fake service plugged into it: what
Envoy's health checks, a worker's supervisor and a caller in flight see from start to drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from sidecar_runtime.h2grpc import Context, Server
from sidecar_runtime.process import service_process
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.service_process import Listen, ServiceCommand, ServiceProcess, run_service
from sidecar_runtime.process.settings import Settings
from tests.harness.waits import until

SERVICE = "test.Fake"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class BadConfig(ValueError):
    pass


def read_config(path: str) -> str:
    text = Path(path).read_text()
    if text.startswith("bad"):
        raise BadConfig(f"{path}:1: bad config")
    return text


class FakeService:
    """Echoes a call once the test releases it; records what happened to it, in order."""

    name = "fake"
    health_name = SERVICE
    max_message_bytes = 1024

    def __init__(self, config_path: str, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("fake_calls", "calls answered", registry=self.registry)
        self.reloader: Reloader[str] = Reloader(config_path, read_config, interval_s=0.02)
        self.ops_pages: Mapping[str, Any] = {"/echo": lambda query: query.get("say", "")}
        self.events: list[str] = []
        self.in_flight = 0
        self.release = asyncio.Event()

    async def open(self, server: Server) -> None:
        self.events.append("open")
        handler = grpc.unary_unary_rpc_method_handler(self._call)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Call": handler}),))

    async def _call(self, request: bytes, context: Context) -> bytes:
        self.in_flight += 1
        await self.release.wait()
        self.events.append("call answered")
        self.calls.inc()
        return request

    async def close(self) -> None:
        self.events.append("close")

    def describe(self) -> Mapping[str, Any]:
        return {"config": self.reloader.current()}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "fake.yaml"
    path.write_text("v1")
    return path


def fake_process(config: Path, port: int = 0, ops_socket: str | None = None,
                 grace_s: float = 30.0) -> ServiceProcess[FakeService]:
    settings = Settings(shutdown_grace_s=grace_s)
    return ServiceProcess(FakeService(str(config), settings),
                          Listen("127.0.0.1", port, 0, ops_socket), settings)


@contextlib.asynccontextmanager
async def channel_to(process: ServiceProcess[FakeService]) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{process.port}") as channel:
        yield channel


def call(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(f"/{SERVICE}/Call")(b"hello", timeout=60)


async def healthz(port: int) -> int:
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{port}/healthz") as reply:
        return reply.status


def polling(reloader: Reloader[Any]) -> bool:
    """Whether a task runs ``reloader.run()``."""
    for task in asyncio.all_tasks():
        frame = getattr(task.get_coro(), "cr_frame", None)
        if not task.done() and frame is not None and frame.f_locals.get("self") is reloader:
            return True
    return False


async def test_serves_then_drains_in_one_order(config: Path) -> None:
    process = fake_process(config)
    service = process.service
    stop = asyncio.Event()
    running = asyncio.create_task(process.run(stop))
    await until(lambda: process.serving or running.done(), timeout_s=30, what="serving")
    assert process.serving and process.metrics_port != 0
    async with channel_to(process) as channel, aiohttp.ClientSession() as session:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == SERVING, name
        ops = f"http://127.0.0.1:{process.metrics_port}"
        async with session.get(f"{ops}/healthz") as reply:
            assert (reply.status, await reply.json()) == (200, {"status": "ok"})
        async with session.get(f"{ops}/echo?say=hi") as reply:
            assert await reply.text() == "hi\n"
        assert polling(service.reloader)
        await asyncio.to_thread(config.write_text, "v2")
        await until(lambda: service.reloader.current() == "v2", timeout_s=10, what="v2 loaded")

        # Envoy watches health on an open stream; a call is in flight when SIGTERM comes.
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == SERVING
        in_flight = asyncio.ensure_future(call(channel))
        await until(lambda: service.in_flight == 1, timeout_s=10, what="the call in flight")
        stop.set()

        assert (await watch.read()).status == NOT_SERVING
        async with session.get(f"{ops}/healthz") as reply:  # the ops server outlives the drain
            assert (reply.status, await reply.json()) == (503, {"status": "unavailable"})
        assert service.events == ["open"]  # nothing is closed under the call in flight
        assert not running.done()

        service.release.set()
        assert await in_flight == b"hello"
        watch.cancel()  # an open Watch stream would hold the drain for the whole grace
        await running
        assert service.events == ["open", "call answered", "close"]
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{ops}/healthz")
    assert not polling(service.reloader)


async def test_a_call_past_the_grace_period_is_cut_and_the_drain_ends(config: Path) -> None:
    process = fake_process(config, grace_s=0.2)
    await process.start()
    async with channel_to(process) as channel:
        in_flight = asyncio.ensure_future(call(channel))
        await until(lambda: process.service.in_flight == 1, timeout_s=10, what="in flight")
        await process.stop()  # the call never finishes on its own
        with pytest.raises(grpc.aio.AioRpcError):
            await in_flight
    assert process.service.events == ["open", "close"]
    await process.stop()  # a second stop does nothing
    assert process.service.events == ["open", "close"]


async def test_a_failed_start_releases_what_it_had_started(config: Path) -> None:
    first = fake_process(config)
    await first.start()
    try:
        # A second copy on the same port fails (no SO_REUSEPORT outside --workers) and
        # leaves nothing behind: the service is closed, no reload polling, no ops server.
        # (grpcio raises RuntimeError for a port it cannot bind; older ones returned 0, which
        # add_port turns into OSError.)
        second = fake_process(config, port=first.port)
        with pytest.raises((RuntimeError, OSError), match=r"(?i)bind|listen"):
            await second.start()
        assert second.service.events == ["open", "close"]
        assert not second.serving and not polling(second.service.reloader)
        with pytest.raises(RuntimeError, match="started twice"):
            await second.start()
    finally:
        await first.stop()


async def test_workers_share_the_port_and_serve_ops_on_their_socket(config: Path,
                                                                    tmp_path: Path) -> None:
    sockets = [str(tmp_path / f"worker-{i}.sock") for i in range(2)]
    first = fake_process(config, ops_socket=sockets[0])
    await first.start()
    second = fake_process(config, port=first.port, ops_socket=sockets[1])
    await second.start()
    try:
        for path in sockets:
            connector = aiohttp.UnixConnector(path=path)
            async with aiohttp.ClientSession(connector=connector) as session, \
                    session.get("http://worker/healthz") as reply:
                assert reply.status == 200
        for process in (first, second):
            process.service.release.set()
        async with channel_to(first) as channel:
            answered = await asyncio.gather(*(call(channel) for _ in range(4)))
        assert answered == [b"hello"] * 4
    finally:
        await first.stop()
        await second.stop()


# -- the command line ------------------------------------------------------------------------


def command(**overrides: Any) -> ServiceCommand:
    def address(path: str) -> tuple[str, int]:
        read_config(path)
        return "127.0.0.1", 0

    fields: dict[str, Any] = {"name": "fake", "default_address": address, "build": FakeService,
                              "config_errors": (BadConfig, OSError)}
    return ServiceCommand(**(fields | overrides))


def args(config_path: Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {"config": str(config_path), "host": None, "port": None,
                              "metrics_port": 0, "workers": None, "worker_ops_socket": None,
                              "worker_index": 0}
    return argparse.Namespace(**(values | overrides))


def refuse(path: str, settings: Settings, workers: int) -> None:
    raise BadConfig(f"{path}:3: refused before {workers} workers start")


def bad_build(path: str, settings: Settings) -> FakeService:
    raise BadConfig(f"{path}:2: bad at start")


@pytest.mark.parametrize(("case", "cmd", "flags", "code", "message"), [
    ("unreadable", {}, {"config": "/nonexistent/fake.yaml"}, 1, "No such file or directory"),
    ("bad at start", {"build": bad_build}, {}, 1, "{config}:2: bad at start"),
    ("workers refused", {}, {"workers": 0}, 2, "fake: --workers must be 1 or more, not 0"),
    ("shared store", {"needs_shared_store": True}, {"workers": 2, "port": 50999}, 2,
     "fake: --workers 2 needs LLM_SIDECAR_REDIS_URL"),
    ("preflight", {"preflight": refuse}, {"workers": 2, "port": 50999}, 1,
     "{config}:3: refused before 2 workers start"),
])
def test_run_service_exit_codes(case: str, cmd: dict[str, Any], flags: dict[str, Any],
                                code: int, message: str, config: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run_service(command(**cmd), args(config, **flags), Settings()) == code, case
    assert message.format(config=config) in capsys.readouterr().err


async def test_the_heap_is_settled_once_the_service_serves(config: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI path freezes the heap after start-up (sidecar_runtime.process.heap), not before the
    service serves, and not for a start that failed."""
    stops: list[asyncio.Event] = []
    seen: list[str] = []
    services: list[FakeService] = []

    def build(path: str, settings: Settings) -> FakeService:
        services.append(FakeService(path, settings))
        return services[-1]

    def settled() -> None:
        seen.append("settled" if services and services[0].events == ["open"] else "early")
        stops[0].set()  # as SIGTERM would

    monkeypatch.setattr(service_process, "install_stop_handlers", stops.append)
    monkeypatch.setattr(service_process, "settle_heap", settled)
    listen = Listen("127.0.0.1", 0, 0, None)
    assert await service_process._serve(command(build=build), str(config), listen,
                                        Settings()) == 0
    assert seen == ["settled"]
    assert services[0].events[-1] == "close"

    seen.clear()
    assert await service_process._serve(command(build=bad_build), str(config), listen,
                                        Settings()) == 1
    assert seen == []
