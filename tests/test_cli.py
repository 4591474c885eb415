"""What a user sees when a command cannot run: one line that says why, never a traceback, and
never a secret."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess

from sidecar_runtime.process.procs import free_port, sidecar_command

EXAMPLE = str(pathlib.Path(__file__).parents[1] / "llm_sidecar" / "example.yaml")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sidecar_command(*args), capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, **(env or {})})


def test_a_bad_setting_is_one_line_naming_the_variable_but_not_its_value() -> None:
    result = run("check", "--config", EXAMPLE,
                 env={"LLM_SIDECAR_REDIS_TIMEOUT_MS": "sk-live-secret"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "llm-sidecar: LLM_SIDECAR_REDIS_TIMEOUT_MS: Input should be a valid integer, unable to "
        "parse string as an integer"]
    assert "sk-live-secret" not in result.stderr + result.stdout


def test_render_into_a_file_is_one_line(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("")
    result = run("render", "--config", EXAMPLE, "--out", str(target))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"llm-sidecar render: --out {target}: File exists: give a folder"]


def test_extproc_on_a_port_in_use_is_one_line(tmp_path: pathlib.Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run("extproc", "--config", EXAMPLE, "--port", str(port),
                     "--metrics-port", str(free_port()), env={"LLM_SIDECAR_DEV_MODE": "true"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "address already in use" in result.stderr.lower()
