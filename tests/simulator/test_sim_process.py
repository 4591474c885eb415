"""The CLI entry point: flags, and a real process that stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import time
from collections.abc import Iterator

import aiohttp
import pytest
import structlog

from routing.schema import SimulateSpec
from simulator import SimConfig, add_arguments, config_from_args, run

LAUNCH = (
    "import argparse, sys\n"
    "from simulator import add_arguments, run\n"
    "parser = argparse.ArgumentParser()\n"
    "add_arguments(parser)\n"
    "sys.exit(run(parser.parse_args(sys.argv[1:])))\n"
)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """``run`` configures structlog for the process; put it back for the tests that follow."""
    config = structlog.get_config()
    bound = structlog.contextvars.get_contextvars()
    yield
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**bound)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_and_defaults() -> None:
    args = _parse("--port", "8000", "--name", "vllm-short")
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert config_from_args(args) == SimConfig(name="vllm-short")
    args = _parse(
        "--port=1", "--name=n", "--max-model-len=32768", "--models= a, b ,",
        "--prefill-ms-per-token=0.5", "--decode-ms-per-token=0", "--default-output-tokens=4",
        "--embedding-dim=8", "--tokenizer=/t.json", "--max-num-seqs=2", "--kv-cache-tokens=9",
    )  # fmt: skip
    assert config_from_args(args) == SimConfig(
        name="n",
        max_model_len=32768,
        models=("a", "b"),
        prefill_ms_per_token=0.5,
        decode_ms_per_token=0.0,
        default_output_tokens=4,
        embedding_dim=8,
        tokenizer="/t.json",
        max_num_seqs=2,
        kv_cache_tokens=9,
    )


def test_picker_signal_flags() -> None:
    args = _parse("--port=1", "--name=n", "--speed=2.5", "--prefix-block-size=32", "--no-dcgm")
    config = config_from_args(args)
    assert (config.speed, config.prefix_block_size, config.dcgm) == (2.5, 32, False)
    defaults = config_from_args(_parse("--port=1", "--name=n"))
    assert (defaults.speed, defaults.prefix_block_size, defaults.dcgm) == (1.0, 16, True)


def test_what_up_passes_from_the_routing_yaml_reaches_the_simulator() -> None:
    spec = SimulateSpec(speed=2.0, kv_cache_tokens=4096, decode_ms_per_token=3.0,
                        stream_interval=4)
    config = config_from_args(_parse("--port=1", "--name=n", *spec.sim_flags()))
    assert (config.speed, config.kv_cache_tokens, config.decode_ms_per_token,
            config.stream_interval) == (2.0, 4096, 3.0, 4)
    defaults = config_from_args(_parse("--port=1", "--name=n", *SimulateSpec().sim_flags()))
    assert defaults == SimConfig(name="n")


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--speed", "0"), "speed must be a positive number"),
        (("--speed", "-1"), "speed must be a positive number"),
        (("--speed", "nan"), "speed must be a positive number"),
        (("--speed", "inf"), "speed must be a positive number"),
        (("--prefix-block-size", "0"), "prefix_block_size must be at least 1"),
        (("--kv-cache-tokens", "0"), "kv_cache_tokens must be at least 1"),
        (("--stream-interval", "0"), "stream_interval must be at least 1"),
    ],
)
def test_invalid_picker_signal_flags(argv: tuple[str, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        config_from_args(_parse("--port=1", "--name=n", *argv))


@pytest.mark.parametrize(
    "argv",
    [("--max-model-len", "0"), ("--default-output-tokens", "0"), ("--decode-ms-per-token", "-1")],
)
@pytest.mark.usefixtures("restore_logging")
def test_invalid_settings_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse("--port", "0", "--name", "n", *argv)) == 2
    assert "simulator_invalid_settings" in capsys.readouterr().err


async def _start(*argv: str) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    line = await asyncio.wait_for(process.stderr.readline(), timeout=15)
    record = json.loads(line)
    assert record["event"] == "simulator_listening", line
    assert record["name"] == "proc-pool"
    return process, record["url"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_real_process_stops_cleanly_mid_stream(signum: signal.Signals) -> None:
    process, url = await _start(
        "--port", "0", "--name", "proc-pool", "--decode-ms-per-token", "100"
    )  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/chat/completions", json=body) as response,
        ):
            assert response.headers["x-sim-name"] == "proc-pool"
            await response.content.readuntil(b"\n\n")
            started = time.monotonic()
            process.send_signal(signum)
            rest = await asyncio.wait_for(response.read(), timeout=5)
        # The in-flight stream was finished, not cut: 100 tokens at 100 ms would take 10 s.
        assert rest.endswith(b"data: [DONE]\n\n")
        assert time.monotonic() - started < 3
        assert await asyncio.wait_for(process.wait(), timeout=5) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    errors = (await process.stderr.read()).decode()
    assert "Traceback" not in errors
    assert "simulator_stopping" in errors
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
        pass


@pytest.mark.usefixtures("restore_logging")
def test_a_busy_port_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run(_parse("--port", str(port), "--name", "n")) == 1
    assert "simulator_cannot_listen" in capsys.readouterr().err


@pytest.mark.parametrize(("level", "logged"), [("error", True), ("critical", False)])
@pytest.mark.usefixtures("restore_logging")
def test_llm_sidecar_sim_logs_at_the_configured_level(
        level: str, logged: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from llm_sidecar.cli import main

    monkeypatch.setenv("LLM_SIDECAR_LOG_LEVEL", level)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["sim", "--port", str(port), "--name", "n"]) == 1
    assert ("simulator_cannot_listen" in capsys.readouterr().err) is logged
