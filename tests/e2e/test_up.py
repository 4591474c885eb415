"""``llm-sidecar up`` as a user runs it: prints the URL, serves, and stops every child."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import yaml

from sidecar_runtime.process.procs import envoy_binary, free_port
from tests.harness.ci import unavailable
from tests.harness.gateway import default_doc


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_no_orphans(kids: set[int]) -> None:
    """Every process ``up`` started has exited (within 10 s)."""
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "orphans left behind"


def up_command(config: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "llm_sidecar", "up", "--config", str(config),
            "--extproc-metrics-port", str(free_port()),
            "--ratelimit-metrics-port", str(free_port())]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_and_stops_every_child(tmp_path: pathlib.Path, sig: signal.Signals) -> None:
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    doc = default_doc()
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(up_command(config), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "llm-sidecar is up: http://" in line, line
        url = line.split("up: ", 1)[1].split()[0]
        assert url == f"http://{doc['envoy']['listen']}/v1"
        kids = descendants(proc.pid)
        assert len(kids) >= 6  # 4 simulators, extproc, envoy
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=10)
        reply = client.chat.completions.create(
            model="llama-2-13b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert_no_orphans(kids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("taken", ["listen", "extproc", "simulator"])
def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path: pathlib.Path,
                                                          taken: str) -> None:
    """Something else listens on a port the config names (a second ``up``, a forgotten
    process): ``up`` names it and starts nothing. Before, it waited for "its" service on that
    port, found the other listener and printed that it was up, or died with a traceback."""
    doc = default_doc()
    address = {"listen": doc["envoy"]["listen"], "extproc": doc["services"]["extproc"],
               "simulator": doc["clusters"]["vllm-short"]["endpoints"][0]}[taken]
    host, port = address.rsplit(":", 1)
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(doc))
    with socket.create_server((host, int(port))):
        result = subprocess.run(up_command(config), capture_output=True, text=True, timeout=60,
                                check=False)
    assert result.returncode == 1
    assert "is up" not in result.stdout
    what = {"listen": "envoy.listen", "extproc": "services.extproc",
            "simulator": "clusters.vllm-short.endpoints"}[taken]
    assert result.stderr.strip().splitlines() == [
        f"llm-sidecar up: {address} ({what}) is in use already"]


def test_ctrl_c_while_starting_stops_at_once_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    """SIGINT before the gateway is up (the simulators are starting): it stops then, not
    after start-up finished, with one line and no traceback, and no child is left."""
    doc = default_doc()
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(up_command(config), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while len(descendants(proc.pid)) < 4:  # the simulators are up and starting
            assert time.monotonic() < deadline and proc.poll() is None, "nothing started"
            time.sleep(0.02)
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert "is up" not in out
        assert err.strip().splitlines()[-1] == "llm-sidecar stopped before it was up"
        assert "Traceback" not in err
        assert_no_orphans(kids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
