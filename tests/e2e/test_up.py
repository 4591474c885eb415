"""``llm-sidecar up`` as a user runs it: prints the URL, serves, and stops every child."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import openai
import pytest
import yaml

from sidecar_runtime.procs import envoy_binary
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_and_stops_every_child(tmp_path: pathlib.Path, sig: signal.Signals) -> None:
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    doc = default_doc()
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen([sys.executable, "-m", "llm_sidecar", "up", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)], "orphans left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
