"""``llm-sidecar plan``: the text report, the JSON shape users and tools read, and errors as
FILE:LINE on stderr with exit 1."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from llmmodel.plan_cli import add_plan_arguments, plan_command
from tests.llmmodel.fixtures.models import line_of, write_model

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "models" / "contract-review.yaml")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="llm-sidecar plan")
    add_plan_arguments(parser)
    code = plan_command(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_report_shows_pools_flags_and_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([EXAMPLE], capsys)
    assert (code, err) == (0, "")
    assert "model contract-review-v2 (chat" in out
    assert "pool contract-review-v2-2k: 2048 tokens on 1 x L40S (tensor parallel 1)" in out
    assert "pool contract-review-v2-4k: 4096 tokens on" in out
    assert "concurrent sequences of 4096 tokens" in out
    lines = out.splitlines()
    flag = lines.index("    --kv-cache-dtype auto")
    assert "819200 B per token" in lines[flag + 1]  # each flag's reason on the next line
    assert "    --max-num-seqs 18" in lines


def test_json_is_the_contract_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([EXAMPLE, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    [model] = doc["models"]
    assert set(model) == {"name", "pools"} and model["name"] == "contract-review-v2"
    for pool in model["pools"]:
        assert set(pool) == {"name", "context", "gpu_class", "gpus_per_replica", "tensor_parallel_size",
                             "vllm_args", "kv_cache_tokens", "max_concurrent_sequences", "reasons"}
        assert pool["vllm_args"][:2] == ["--max-model-len", str(pool["context"])]
        assert all(isinstance(a, str) for a in pool["vllm_args"])
        assert "--gpu-memory-utilization" in pool["reasons"]
    assert [p["context"] for p in model["pools"]] == [2048, 4096]


def test_invalid_model_exits_1_with_file_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_model(tmp_path, base="llama-2-13b", gpuRequest="forty")
    code, out, err = _run([str(path)], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"{path}:{line_of(path, 'gpuRequest')}: ")
    assert "Traceback" not in err


def test_unfittable_model_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_model(tmp_path, base="llama-2-70b", gpuRequest="16Gi")
    code, _, err = _run([str(path)], capsys)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(f"{path}:{line_of(path, 'gpuRequest')}: pool m-2k")


def test_bad_gpus_file_and_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("gpus:\n  - {name: X}\n", encoding="utf-8")
    code, _, err = _run([EXAMPLE, "--gpus", str(gpus)], capsys)
    assert code == 1 and err.startswith(f"{gpus}:2: ")
    empty = tmp_path / "none"
    empty.mkdir()
    code, _, err = _run([str(empty)], capsys)
    assert code == 1 and "no LLMModel files" in err


def test_gpus_file_changes_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("nodes:\n  - {gpu: H100-80GB}\n", encoding="utf-8")
    code, out, _ = _run([EXAMPLE, "--gpus", str(gpus), "--json"], capsys)
    assert code == 0
    assert {p["gpu_class"] for p in json.loads(out)["models"][0]["pools"]} == {"H100-80GB"}


def _config_dir(tmp_path: Path, **config: object) -> str:
    weights = tmp_path / "weights"
    weights.mkdir()
    base = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "max_position_embeddings": 4096}
    (weights / "config.json").write_text(json.dumps({**base, **config}), encoding="utf-8")
    return "weights"


ARCH = {"parameters": "7B", "layers": 32, "hidden_size": 4096, "attention_heads": 32, "max_position": 4096}
NO_TRACEBACK_CASES: list[tuple[str, dict[str, object], str]] = [
    # (case, spec keys, the key whose line the error names); a callable value is called with tmp_path
    ("head size 0", {"architecture": {**ARCH, "hidden_size": 1, "attention_heads": 10000}}, "architecture"),
    ("gpuRequest 400 nines", {"base": "llama-2-7b", "gpuRequest": "9" * 400 + "Gi"}, "gpuRequest"),
    ("parameters 400 nines T", {"architecture": {**ARCH, "parameters": "9" * 400 + "T"}}, "architecture"),
    ("parameters a 400-digit int", {"architecture": {**ARCH, "parameters": "9" * 400}}, "architecture"),
    ("config.json without heads", {"modelPath": lambda p: _config_dir(p, num_attention_heads=0)},
     "modelPath"),
    ("config.json huge intermediate",
     {"modelPath": lambda p: _config_dir(p, intermediate_size=int("9" * 400))}, "modelPath"),
]


@pytest.mark.parametrize(("spec", "key"), [c[1:] for c in NO_TRACEBACK_CASES],
                         ids=[c[0] for c in NO_TRACEBACK_CASES])
def test_out_of_range_input_exits_1_with_file_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  spec: dict[str, object], key: str) -> None:
    given: dict[str, Any] = {k: v(tmp_path) if callable(v) else v for k, v in spec.items()}
    path = write_model(tmp_path, **given)
    code, out, err = _run([str(path)], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"{path}:{line_of(path, key)}: ") and err.count("\n") == 1, err
