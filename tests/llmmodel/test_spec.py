"""A bad field of an LLMModel is one ``FILE:LINE: message`` at the line of that field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from llmmodel.spec import load_models
from routing.errors import ConfigError
from tests.llmmodel.fixtures.models import line_of, model_text, write_model

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, spec keys, key whose line the error names, words the message holds)
    ("gpuRequest in words", {"gpuRequest": "forty"}, "gpuRequest", "is not a size"),
    ("gpuRequest below 1Gi", {"gpuRequest": "512Mi"}, "gpuRequest", "at least 1Gi"),
    ("availability 100%", {"sla": {"p99Latency": "200ms", "availability": "100%"}}, "sla",
     "below 100%"),
    ("latency in words", {"sla": {"p99Latency": "fast"}}, "sla", "is not a duration"),
    ("unknown quantization", {"quantization": "q3_k_s"}, "quantization", "quantization"),
    ("unknown key", {"gpuClas": "L4"}, "gpuClas", "unknown key 'gpuClas'"),
    ("bad model path", {"modelPath": "ftp://x y"}, "modelPath", "give s3://"),
    ("context too short", {"contexts": [64]}, "contexts", "from 128"),
    ("context twice", {"contexts": [2048, 2048]}, "contexts", "listed twice"),
    ("kv heads not dividing", {"architecture": {"parameters": "7B", "layers": 32, "hidden_size": 4096,
                                                "attention_heads": 32, "kv_heads": 5,
                                                "max_position": 4096}},
     "architecture", "multiple of kv_heads"),
    ("head size 0", {"architecture": {"parameters": "7B", "layers": 32, "hidden_size": 1,
                                      "attention_heads": 10000, "max_position": 4096}},
     "architecture", "gives a head size of 0"),
    ("gpuRequest of 400 digits", {"gpuRequest": "9" * 400 + "Gi"}, "gpuRequest", "too large: at most 1Pi"),
    ("gpuRequest above 1Pi", {"gpuRequest": "2048Ti"}, "gpuRequest", "too large: at most 1Pi"),
    ("parameters of 400 digits", {"architecture": {"parameters": "9" * 400 + "T", "layers": 40,
                                                   "hidden_size": 5120, "attention_heads": 40,
                                                   "max_position": 4096}},
     "architecture", "too large: at most 1000T"),
    ("parameters a 400-digit int", {"architecture": {"parameters": "9" * 400, "layers": 40,
                                                     "hidden_size": 5120, "attention_heads": 40,
                                                     "max_position": 4096}},
     "architecture", "too large: at most 1000T"),
    ("availability as a fraction", {"sla": {"p99Latency": "200ms", "availability": 0.999}}, "sla",
     "write the availability as a percentage like 99.9%"),
    ("availability 10%", {"sla": {"p99Latency": "200ms", "availability": "10%"}}, "sla",
     "write the availability as a percentage"),
    ("name starting with a digit", {"_name": "1abc"}, "name", "starting with a letter"),
    ("name with a trailing newline", {"_name": '"abc\\n"'}, "name", "starting with a letter"),
    ("canaryOf not a model name", {"canaryOf": "Big_Model"}, "canaryOf", "a model name is"),
    ("self canary", {"canary": {"model": "m", "percent": 5}}, "canary", "cannot be its own canary"),
    ("canaryOf itself", {"canaryOf": "m"}, "canaryOf", "cannot be the canary of itself"),
    ("a canary with a canary", {"canaryOf": "a", "canary": {"model": "c", "percent": 5}}, "canary",
     "has no canary of its own"),
]

PATH_CASES: list[tuple[str, str]] = [
    # (modelPath, words the message holds)
    ("pvc:///weights", "PersistentVolumeClaim"),
    ("pvc://Models_1/weights", "PersistentVolumeClaim"),
    ("pvc://models/../etc", "no '..' segment"),
    ("pvc://models/a/%2e%2e/b", "no '..' segment"),
    ("/models/../etc/passwd", "no '..' segment"),
    ("../weights", "no '..' segment"),
    ("s3://models/..\\etc", "no '..' segment"),
    ("hf://meta-llama", "hf://ORG/NAME"),
    ("hf://meta-llama/Llama-2-7b/extra", "hf://ORG/NAME"),
    ("hf:///Llama-2-7b", "hf://ORG/NAME"),
    ("hf://-org/model", "hf://ORG/NAME"),
    ("hf://org/mo%del", "hf://ORG/NAME"),
    ("s3:///contract.gguf", "s3://BUCKET/KEY"),
    ("gs://", "gs://BUCKET/KEY"),
    ("ftp://host/weights", "give s3://"),
]


@pytest.mark.parametrize(("value", "words"), PATH_CASES, ids=[c[0] for c in PATH_CASES])
@pytest.mark.parametrize("where", ["modelPath", "canary"])
def test_bad_model_path_is_an_error_at_its_line(tmp_path: Path, value: str, words: str, where: str) -> None:
    spec: dict[str, Any] = {"base": "llama-2-7b"}
    if where == "modelPath":
        spec["modelPath"] = f"'{value}'"
    else:
        spec["canary"] = {"model": "m2", "percent": 5, "modelPath": f"'{value}'"}
    path = write_model(tmp_path, **spec)
    with pytest.raises(ConfigError) as caught:
        load_models([str(path)])
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), line_of(path, where)), str(caught.value)
    assert words in problem.message, problem.message


@pytest.mark.parametrize("value", ["s3://models/contract-v2.gguf", "gs://my_bucket/a/b", "hf://meta-llama/Llama-2-7b-hf",
                                   "hf://org/model.v1_2", "pvc://models/contract-v2", "pvc://models.team-a",
                                   "/models/llama", "weights/llama", "./weights"])
def test_good_model_paths_load(tmp_path: Path, value: str) -> None:
    [model] = load_models([str(write_model(tmp_path, base="llama-2-7b", modelPath=value))])
    assert model.spec.model_path == value


@pytest.mark.parametrize(("spec", "key", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_field_is_one_file_line_error(tmp_path: Path, spec: dict[str, Any], key: str,
                                          words: str) -> None:
    name = spec.pop("_name", "m")
    path = write_model(tmp_path, name, **spec)
    with pytest.raises(ConfigError) as caught:
        load_models([str(path)])
    assert len(caught.value.problems) == 1, str(caught.value)
    problem = caught.value.problems[0]
    assert (problem.file, problem.line) == (str(path), line_of(path, key)), str(caught.value)
    assert words in problem.message


def test_good_model_loads_with_defaults(tmp_path: Path) -> None:
    model = load_models([str(write_model(tmp_path, base="llama-2-13b"))])[0]
    assert model.spec.quantization == "fp16"
    assert model.spec.gpu_request_bytes == 40 << 30
    assert model.spec.sla.p99_latency_s == pytest.approx(0.2)
    assert model.spec.sla.availability_fraction == pytest.approx(0.9995)


def test_a_fifo_named_like_a_model_is_refused_without_being_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    write_model(tmp_path, "good", base="llama-2-7b")
    with pytest.raises(ConfigError) as caught:
        load_models([str(tmp_path)])
    assert [str(p) for p in caught.value.problems] == [
        f"{fifo}:1: not a regular file (a FIFO, device or socket is not read)"]


def test_a_link_to_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")  # read to its end, it would fill the memory
    with pytest.raises(ConfigError) as caught:
        load_models([str(link)])
    assert [str(p) for p in caught.value.problems] == [
        f"{link}:1: not a regular file (a FIFO, device or socket is not read)"]


def test_a_file_above_1_mib_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-7b")
    with path.open("a", encoding="utf-8") as handle:
        handle.write("# padding\n" * 120_000)
    with pytest.raises(ConfigError) as caught:
        load_models([str(path)])
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), 1)
    assert problem.message == f"{path.stat().st_size} bytes, more than the 1048576 read"


def test_a_file_not_in_utf8_is_one_problem(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(model_text("m", base="llama-2-7b").encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        load_models([str(path)])
    assert [str(p) for p in caught.value.problems] == [f"{path}:1: not UTF-8 text"]
