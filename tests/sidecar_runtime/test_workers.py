"""``--workers N``: what is refused (and why), the flags, and how workers' metrics add up."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm_sidecar.cli import _dispatch, _parser
from sidecar_runtime.process.metrics_merge import Scrape, exposition, merge
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.workers import Supervisor, port_in_use, workers_problem


def main(argv: list[str]) -> int:
    """``llm-sidecar ARGV`` in this process, without configuring logging (which would keep
    pytest's captured stderr after the test)."""
    return _dispatch(_parser().parse_args(argv), Settings())


EXAMPLE = str(Path(__file__).resolve().parents[2] / "llm_sidecar" / "example.yaml")


@pytest.mark.parametrize(("workers", "host", "port", "needs_store", "problem"), [
    (1, "127.0.0.1", 50051, False, None),
    (1, "unix:/run/x.sock", 0, True, None),  # one worker: as before, anything goes
    (4, "0.0.0.0", 50051, False, None),
    (0, "127.0.0.1", 50051, False, "--workers must be 1 or more, not 0"),
    (-2, "127.0.0.1", 50051, False, "--workers must be 1 or more, not -2"),
    (2, "unix:/run/x.sock", 0, False, "a Unix socket (unix:/run/x.sock) cannot be shared"),
    (2, "127.0.0.1", 0, False, "needs a fixed --port"),
    (3, "127.0.0.1", 50052, True, "every limit would be 3 times too loose"),
])
def test_workers_problem(workers: int, host: str, port: int, needs_store: bool,
                         problem: str | None) -> None:
    found = workers_problem("svc", workers, host, port, needs_store)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and found.startswith("svc: ")


@pytest.mark.parametrize("command", ["extproc", "ratelimit"])
def test_workers_flag(command: str) -> None:
    args = _parser().parse_args([command, "--config", EXAMPLE, "--workers", "3"])
    assert args.workers == 3 and args.worker_ops_socket is None
    default = _parser().parse_args([command, "--config", EXAMPLE])
    assert default.workers is None  # then LLM_SIDECAR_WORKERS, else 1
    with pytest.raises(SystemExit):
        _parser().parse_args([command, "--config", EXAMPLE, "--workers", "two"])


def test_worker_flags_are_hidden_from_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["extproc", "--help"])
    out = capsys.readouterr().out
    assert "--workers" in out and "--worker-ops-socket" not in out


def test_ratelimit_workers_without_redis_is_refused(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_SIDECAR_REDIS_URL", raising=False)
    assert main(["ratelimit", "--config", EXAMPLE, "--workers", "2", "--port", "1"]) == 2
    assert "needs LLM_SIDECAR_REDIS_URL" in capsys.readouterr().err


def test_workers_from_the_environment_are_checked_too(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_SIDECAR_REDIS_URL", raising=False)
    monkeypatch.setenv("LLM_SIDECAR_WORKERS", "2")
    assert main(["ratelimit", "--config", EXAMPLE, "--port", "1"]) == 2
    assert "--workers 2 needs LLM_SIDECAR_REDIS_URL" in capsys.readouterr().err


def test_extproc_workers_on_a_unix_socket_is_refused(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    host = f"unix:{tmp_path}/extproc.sock"
    assert main(["extproc", "--config", EXAMPLE, "--workers", "2", "--host", host]) == 2
    assert "cannot be shared by several processes" in capsys.readouterr().err


def test_workers_refuse_a_port_already_taken(capsys: pytest.CaptureFixture[str]) -> None:
    # With SO_REUSEPORT the workers would otherwise join a forgotten instance's port.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        assert main(["extproc", "--config", EXAMPLE, "--workers", "2", "--port", str(port),
                     "--metrics-port", "0"]) == 2
    assert "is in use already" in capsys.readouterr().err
    assert not port_in_use("127.0.0.1", port)


def _worker(requests: float, latency: float, breaker: int, reload_ok: int) -> str:
    registry = CollectorRegistry()
    Counter("llm_sidecar_requests", "r", ["model"], registry=registry).labels("m").inc(requests)
    Histogram("llm_sidecar_extproc_message_seconds", "h", buckets=(0.1, 1.0),
              registry=registry).observe(latency)
    Gauge("ratelimit_breaker_state", "b", registry=registry).set(breaker)
    Gauge("extproc_config_last_reload_ok", "ok", registry=registry).set(reload_ok)
    return generate_latest(registry).decode()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def test_merge_sums_counters_and_histograms_and_takes_the_worst_gauge() -> None:
    merged = _samples(exposition(merge([Scrape(_worker(3, 0.05, 0, 1)),
                                        Scrape(_worker(4, 0.5, 1, 0))])))
    assert merged[("llm_sidecar_requests_total", (("model", "m"),))] == 7
    bucket = "llm_sidecar_extproc_message_seconds_bucket"
    assert merged[(bucket, (("le", "0.1"),))] == 1
    assert merged[(bucket, (("le", "1.0"),))] == 2
    assert merged[("llm_sidecar_extproc_message_seconds_count", ())] == 2
    assert merged[("llm_sidecar_extproc_message_seconds_sum", ())] == pytest.approx(0.55)
    assert merged[("ratelimit_breaker_state", ())] == 1  # one worker's breaker is open
    assert merged[("extproc_config_last_reload_ok", ())] == 0  # one worker rejected a reload


def test_a_replaced_worker_keeps_its_counts_but_not_its_gauges() -> None:
    merged = _samples(exposition(merge([Scrape(_worker(5, 0.05, 1, 0), live=False),
                                        Scrape(_worker(2, 0.05, 0, 1))])))
    assert merged[("llm_sidecar_requests_total", (("model", "m"),))] == 7
    assert merged[("ratelimit_breaker_state", ())] == 0
    assert merged[("extproc_config_last_reload_ok", ())] == 1


def test_requests_open_on_a_pod_add_up_over_the_live_workers() -> None:
    def worker(open_requests: int) -> str:
        registry = CollectorRegistry()
        Gauge("llm_sidecar_endpoint_in_flight", "open", ["cluster", "endpoint"],
              registry=registry).labels("pool", "10.0.0.1:8000").set(open_requests)
        return generate_latest(registry).decode()
    merged = _samples(exposition(merge([Scrape(worker(2)), Scrape(worker(3)),
                                        Scrape(worker(7), live=False)])))
    assert merged[("llm_sidecar_endpoint_in_flight",
                   (("cluster", "pool"), ("endpoint", "10.0.0.1:8000")))] == 5


def test_merge_keeps_help_and_type() -> None:
    text = exposition(merge([Scrape(_worker(1, 0.05, 0, 1))])).decode()
    assert "# TYPE llm_sidecar_requests_total counter" in text
    assert "# TYPE llm_sidecar_extproc_message_seconds histogram" in text
    assert "# HELP ratelimit_breaker_state b" in text


class _Child:
    """Stands in for a worker's process: alive until told otherwise."""

    def __init__(self) -> None:
        self.up = True
        self.process = SimpleNamespace(returncode=-9, kill=self.stop)

    def stop(self) -> None:
        self.up = False

    def alive(self) -> bool:
        return self.up


async def test_a_worker_replaced_during_a_scrape_is_counted_once_and_retired_counts_fold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape that was in flight when its worker died and was replaced must not put the dead
    worker's numbers back as the new one's (counted twice, then lost); a restart folds the
    dead worker's counts into one retired text, which does not grow with every restart."""
    supervisor = Supervisor("extproc", 1, lambda i, s: [], "127.0.0.1", 0, 1.0)
    worker = supervisor._workers[0]
    old, new = _Child(), _Child()
    worker.child = old  # type: ignore[assignment]
    worker.ready = True

    async def replaced_meanwhile(_w: object, _path: str, _timeout: float = 5) -> tuple[int, str]:
        worker.child = new  # type: ignore[assignment]  # the restart happened during the read
        return 200, _worker(9, 0.05, 0, 1)
    monkeypatch.setattr(supervisor, "_get", replaced_meanwhile)
    await supervisor._refresh()
    assert worker.last_text is None

    monkeypatch.setattr(supervisor, "_spawn", lambda w: None)
    monkeypatch.setattr(supervisor, "_wait_ready", _ready)
    for requests in (3, 4, 5):
        worker.last_text = _worker(requests, 0.05, 0, 1)
        await supervisor._restart(worker)
    assert len(supervisor._retired) == 1
    retired = _samples(supervisor._retired[0].encode())
    assert retired[("llm_sidecar_requests_total", (("model", "m"),))] == 12
    shutil.rmtree(supervisor._dir)


async def _ready(_worker: object) -> None:
    return None


async def test_a_restart_whose_fork_fails_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory pressure that OOM-killed a worker can make the fork of its replacement fail
    (ENOMEM, EAGAIN): the restart is tried again, not given up for good."""
    supervisor = Supervisor("extproc", 1, lambda i, s: [], "127.0.0.1", 0, 1.0)
    worker = supervisor._workers[0]
    worker.child = _Child()  # type: ignore[assignment]
    attempts: list[int] = []

    def spawn(_w: object) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(supervisor, "_spawn", spawn)
    monkeypatch.setattr(supervisor, "_wait_ready", _ready)
    monkeypatch.setattr("sidecar_runtime.process.workers.RESTART_BACKOFF_S", (0.01, 0.01))
    await supervisor._restart(worker)
    assert len(attempts) == 2
    shutil.rmtree(supervisor._dir)
