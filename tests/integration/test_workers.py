"""``llm-sidecar extproc|ratelimit --workers 2`` as real processes: both workers serve the one
port, ``/metrics`` adds them up, a reload reaches both, a dead worker is replaced without losing
its counts, and SIGTERM drains everything (a stream in flight finishes) with exit 0."""

from __future__ import annotations

import contextlib
import http.client
import os
import queue
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.h2_extproc_load import body, headers
from sidecar_runtime.process.procs import Child, _wait_until, free_port, sidecar_command, start, wait_http_ok
from tests.harness.redis_servers import RedisServer

MAX_CONNECTIONS = 200
"""New connections tried until both workers have served one (each lands on either worker, so
missing one 200 times has odds of 2^-199)."""


def _children(pid: int) -> dict[int, tuple[int, str]]:
    """worker index -> (pid, ops socket) of the supervisor ``pid``'s live workers."""
    found: dict[int, tuple[int, str]] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if "--worker-ops-socket" in argv:
                index = int(argv[argv.index("--worker-index") + 1])
                found[index] = (int(child), argv[argv.index("--worker-ops-socket") + 1])
    return found


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("worker", timeout=5)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(5)
        self.sock.connect(self._path)


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def worker_metric(ops_socket: str, name: str, **labels: str) -> float:
    conn = _UnixHTTP(ops_socket)
    try:
        conn.request("GET", "/metrics")
        return _metric(conn.getresponse().read().decode(), name, **labels)
    finally:
        conn.close()


def merged_metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return _metric(resp.read().decode(), name, **labels)


def health_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def wait_for(condition: object, what: str, child: Child) -> None:
    assert callable(condition)
    _wait_until(condition, 60, child, what)


def assert_stops_cleanly(supervisor: Child, workers: dict[int, tuple[int, str]]) -> None:
    assert supervisor.process.wait(90) == 0
    # The supervisor exits only after it reaped every worker.
    assert not [pid for pid, _ in workers.values() if Path(f"/proc/{pid}").exists()]


# -- extproc ------------------------------------------------------------------------------

def routing(port: int, models: tuple[str, ...]) -> dict[str, object]:
    return {"version": 1,
            "services": {"extproc": f"127.0.0.1:{port}", "ratelimit": "127.0.0.1:1"},
            "clusters": {"pool": {"endpoints": ["127.0.0.1:9"], "max_context": 4096}},
            "models": {m: {"clusters": ["pool"]} for m in models},
            # Every response read, so each stream takes all four messages a chat's can.
            "telemetry": {"sample": 1}}


def chat_stream(model: str) -> list[pb.ProcessingRequest]:
    return [
        headers("request_headers", [(":method", "POST"), (":path", "/v1/chat/completions"),
                                    ("content-type", "application/json")]),
        body("request_body", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
             % model.encode()),
        headers("response_headers", [(":status", "200"), ("content-type", "application/json")]),
        body("response_body", b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2, '
                              b'"total_tokens": 5}}'),
    ]


class Stream:
    """One ext_proc stream on its own connection, fed message by message."""

    def __init__(self, port: int) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._sent: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self._answers = pb_grpc.ExternalProcessorStub(self._channel).Process(
            iter(self._sent.get, None))

    def exchange(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self._sent.put(message)
        answer: pb.ProcessingResponse = next(self._answers)
        return answer

    def close(self) -> None:
        self._answers.cancel()  # as Envoy resets the stream after the last answer
        self._channel.close()


def routed(port: int, model: str) -> None:
    stream = Stream(port)
    try:
        for message in chat_stream(model):
            answer = stream.exchange(message)
            assert answer.WhichOneof("response") != "immediate_response", answer
    finally:
        stream.close()


@pytest.fixture
def extproc(tmp_path: Path) -> Iterator[tuple[Child, int, int, Path]]:
    port, metrics = free_port(), free_port()
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(routing(port, ("m1",))))
    supervisor = start("extproc", sidecar_command(
        "extproc", "--config", str(config), "--metrics-port", str(metrics), "--workers", "2"),
        env={**os.environ, "LLM_SIDECAR_RELOAD_INTERVAL_S": "0.1",
             "LLM_SIDECAR_SHUTDOWN_GRACE_S": "60", "LLM_SIDECAR_DEV_MODE": "true"})
    try:
        wait_http_ok(f"http://127.0.0.1:{metrics}/healthz", 120, supervisor)
        yield supervisor, port, metrics, config
    finally:
        supervisor.stop(90)


def test_extproc_workers_share_the_port_and_add_up(
        extproc: tuple[Child, int, int, Path]) -> None:
    supervisor, port, metrics, config = extproc
    workers = _children(supervisor.process.pid)
    assert sorted(workers) == [0, 1]
    decisions = "llm_sidecar_route_decisions_total"

    def per_worker() -> list[float]:
        return [worker_metric(sock, decisions) for _, sock in workers.values()]

    sent = 0
    while min(per_worker()) == 0:  # until both workers routed at least one
        assert sent < MAX_CONNECTIONS, per_worker()
        routed(port, "m1")
        sent += 1
    assert sum(per_worker()) == sent
    assert merged_metric(metrics, decisions) == sent  # one /metrics, both workers in it

    # A config change reaches every worker.
    config.write_text(yaml.safe_dump(routing(port, ("m1", "m2"))))
    reloads = "extproc_config_reloads_total"
    wait_for(lambda: all(worker_metric(sock, reloads, result="ok") == 1
                         for _, sock in workers.values()), "both workers reloaded", supervisor)
    assert merged_metric(metrics, reloads, result="ok") == 2
    for _ in range(4):
        routed(port, "m2")  # whichever worker answers knows m2
    sent += 4

    # A worker killed outright is replaced; what it counted stays in the sums.
    assert merged_metric(metrics, decisions) == sent
    os.kill(workers[0][0], signal.SIGKILL)
    wait_for(lambda: merged_metric(metrics, "llm_sidecar_worker_restarts_total") == 1
             and health_status(metrics) == 200, "worker 0 replaced", supervisor)
    workers = _children(supervisor.process.pid)
    assert sorted(workers) == [0, 1]
    assert merged_metric(metrics, decisions) == sent
    assert worker_metric(workers[0][1], decisions) == 0  # the new worker 0 starts afresh

    # SIGTERM: /healthz says 503 at once, a stream in flight is still answered to its end.
    stream = Stream(port)
    first, *rest = chat_stream("m1")
    stream.exchange(first)
    supervisor.process.send_signal(signal.SIGTERM)
    wait_for(lambda: health_status(metrics) == 503, "/healthz 503 while draining", supervisor)
    for message in rest:
        assert stream.exchange(message).WhichOneof("response") != "immediate_response"
    stream.close()
    assert_stops_cleanly(supervisor, workers)


def test_a_worker_restarted_on_a_refused_edit_or_found_hung_serves_on(
        extproc: tuple[Child, int, int, Path]) -> None:
    """An edit that fails ``check`` is refused by the workers serving; a worker that dies after
    it (an OOM kill) comes back on the last config that loaded instead of failing its start
    and taking every worker down. A worker whose event loop is stuck (SIGSTOP: the kernel still
    hands it connections) stops answering its health probes and is killed and replaced."""
    supervisor, port, metrics, config = extproc
    workers = _children(supervisor.process.pid)
    good = config.read_text()
    config.write_text(good + "no_such_key: 1\n")
    reloads = "extproc_config_reloads_total"
    wait_for(lambda: all(worker_metric(sock, reloads, result="error") == 1
                         for _, sock in workers.values()), "the edit refused", supervisor)
    os.kill(workers[0][0], signal.SIGKILL)
    wait_for(lambda: merged_metric(metrics, "llm_sidecar_worker_restarts_total") == 1
             and health_status(metrics) == 200, "worker 0 back on the last good config",
             supervisor)
    assert supervisor.alive()
    for _ in range(8):
        routed(port, "m1")  # whichever worker answers, m1 is routed

    workers = _children(supervisor.process.pid)
    os.kill(workers[1][0], signal.SIGSTOP)
    try:
        wait_for(lambda: merged_metric(metrics, "llm_sidecar_worker_restarts_total") == 2
                 and health_status(metrics) == 200, "the hung worker replaced", supervisor)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[1][0], signal.SIGCONT)
    assert not Path(f"/proc/{workers[1][0]}").exists() or \
        Path(f"/proc/{workers[1][0]}/stat").read_text().split()[2] == "Z"
    for _ in range(8):
        routed(port, "m1")
    config.write_text(good)
    supervisor.process.send_signal(signal.SIGTERM)
    assert_stops_cleanly(supervisor, _children(supervisor.process.pid))


# -- ratelimit ----------------------------------------------------------------------------

LIMIT = 10
DESCRIPTORS = f"""
domain: llm
descriptors:
  - key: api_key
    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}
"""


def should_rate_limit(port: int) -> int:
    request = rls_pb2.RateLimitRequest(domain="llm", hits_addend=1, descriptors=[
        ratelimit_pb2.RateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="api_key", value="k")])])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, timeout=10)
    return int(reply.overall_code)


@pytest.mark.redis
def test_ratelimit_workers_enforce_one_limit_and_add_up(redis_server: RedisServer,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "ratelimit.yaml"
    config.write_text(DESCRIPTORS)
    port, metrics = free_port(), free_port()
    supervisor = start("ratelimit", sidecar_command(
        "ratelimit", "--config", str(config), "--port", str(port), "--metrics-port",
        str(metrics), "--workers", "2"),
        env={**os.environ, "LLM_SIDECAR_REDIS_URL": redis_server.url,
             "LLM_SIDECAR_REDIS_TIMEOUT_MS": "2000", "LLM_SIDECAR_DEV_MODE": "true"})
    try:
        wait_http_ok(f"http://127.0.0.1:{metrics}/healthz", 120, supervisor)
        workers = _children(supervisor.process.pid)
        assert sorted(workers) == [0, 1]

        def per_worker() -> list[float]:
            return [worker_metric(sock, "ratelimit_requests_total")
                    for _, sock in workers.values()]

        codes: list[int] = []
        while len(codes) < 2 * LIMIT or min(per_worker()) == 0:
            assert len(codes) < MAX_CONNECTIONS, per_worker()
            codes.append(should_rate_limit(port))
        ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
        # One bucket in Redis for both workers: the limit, not twice it.
        assert codes.count(ok) == LIMIT and codes.count(over) == len(codes) - LIMIT
        assert merged_metric(metrics, "ratelimit_requests_total", code="ok") == LIMIT
        assert merged_metric(metrics, "ratelimit_requests_total") == len(codes)

        supervisor.process.send_signal(signal.SIGTERM)
        assert_stops_cleanly(supervisor, workers)
    finally:
        supervisor.stop(90)
