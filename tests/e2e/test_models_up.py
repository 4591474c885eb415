"""``llm-sidecar up --models DIR`` as a user runs it: a model file added to DIR answers within
10 s, a broken file changes nothing, a removed one answers 404, and Envoy is never restarted."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest
import yaml

from sidecar_runtime.process.procs import envoy_binary, free_port
from tests.e2e.test_up import descendants
from tests.harness.ci import unavailable
from tests.harness.waits import wait_for

pytestmark = pytest.mark.e2e

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "models" / "contract-review.yaml"
FIRST = "contract-review-v2"
SECOND = "contract-review-v3"
ADD_BUDGET_S = 10.0
"""The promise of `up --models`: a new model answers within 10 s of its file appearing."""


@dataclass
class Up:
    process: subprocess.Popen[str]
    client: openai.OpenAI
    stderr: pathlib.Path

    def envoy_pids(self) -> set[int]:
        found = set()
        for pid in descendants(self.process.pid):
            try:
                command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if os.path.basename(command.decode()) == "envoy":
                found.add(pid)
        return found

    def said(self) -> str:
        return self.stderr.read_text(errors="replace")


def chat(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    return answer.model


def answers(client: openai.OpenAI, model: str) -> bool:
    try:
        return chat(client, model) == model
    except openai.NotFoundError:
        return False


def unknown(client: openai.OpenAI, model: str) -> bool:
    try:
        chat(client, model)
    except openai.NotFoundError as err:
        body = err.body if isinstance(err.body, dict) else {}
        return body.get("code") == "model_not_found"
    return False


@contextmanager
def running_up(tmp_path: pathlib.Path, *model_files: pathlib.Path) -> Iterator[Up]:
    """``llm-sidecar up --models tmp_path/models`` (holding copies of ``model_files``) on free
    ports, stopped with Ctrl-C afterwards."""
    try:
        envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    models = tmp_path / "models"
    models.mkdir()
    for path in model_files:
        shutil.copy(path, models / path.name)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "version": 1,
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
        "services": {"extproc": f"127.0.0.1:{free_port()}",
                     "ratelimit": f"127.0.0.1:{free_port()}"},
    }))
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w", encoding="utf-8") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "llm_sidecar", "up", "--models", str(models),
             "--config", str(base), "--extproc-metrics-port", str(free_port()),
             "--ratelimit-metrics-port", str(free_port())],
            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "llm-sidecar is up: http://" in line, line + stderr.read_text()
        url = line.split("up: ", 1)[1].split()[0]
        # Envoy's access log follows on stdout: read it, or a full pipe would stall Envoy.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield Up(process, openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                                        timeout=10), stderr)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def up(tmp_path: pathlib.Path) -> Iterator[Up]:
    with running_up(tmp_path, EXAMPLE) as running:
        yield running


def test_models_come_and_go_while_envoy_keeps_running(up: Up, tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    envoy = up.envoy_pids()
    assert len(envoy) == 1
    assert chat(up.client, FIRST) == FIRST
    assert unknown(up.client, SECOND)

    # Added: written beside DIR, then moved in (the file appears whole, as a copy would).
    second = EXAMPLE.read_text().replace(FIRST, SECOND)
    scratch = tmp_path / "second.yaml"
    scratch.write_text(second)
    appeared = time.monotonic()
    os.replace(scratch, models / "second.yaml")
    wait_for(lambda: answers(up.client, SECOND), timeout=30, what="the new model to answer",
             interval=0.1)
    took = time.monotonic() - appeared
    print(f"\nnew model answered {took:.2f} s after its file appeared")
    assert took <= ADD_BUDGET_S
    assert chat(up.client, FIRST) == FIRST

    # A broken file: one FILE:LINE line, and both models are served as before.
    broken = models / "broken.yaml"
    broken.write_text(second.replace(SECOND, "contract-review-v4").replace(
        "gpuRequest: 40Gi", "gpuRequest: lots"))
    wait_for(lambda: f"{broken}:" in up.said(), timeout=20, what="the broken file's problem")
    [problem] = [line for line in up.said().splitlines() if line.startswith(f"{broken}:")]
    assert "gpuRequest" in problem, problem
    assert answers(up.client, FIRST) and answers(up.client, SECOND)
    broken.unlink()

    # Removed: the model is unknown again.
    (models / "second.yaml").unlink()
    wait_for(lambda: unknown(up.client, SECOND), timeout=20, what="the removed model's 404",
             interval=0.1)
    assert chat(up.client, FIRST) == FIRST
    assert up.envoy_pids() == envoy
    assert up.process.poll() is None


def test_an_empty_folder_serves_no_model_until_a_file_appears(tmp_path: pathlib.Path) -> None:
    with running_up(tmp_path) as empty:
        assert unknown(empty.client, FIRST)
        shutil.copy(EXAMPLE, tmp_path / "models" / EXAMPLE.name)
        wait_for(lambda: answers(empty.client, FIRST), timeout=30,
                 what="the first model to answer", interval=0.1)
        assert "not applied" not in empty.said()
