"""Where the architecture comes from: the catalog, ``architecture:``, a local config.json or a
GGUF header; and the errors when it cannot be found."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from llmmodel.arch import estimate_parameters, read_hf_config, resolve_architecture
from llmmodel.catalog import BASE_MODELS
from routing.errors import ConfigError
from tests.llmmodel.fixtures.models import line_of, load_one, write_gguf, write_model

# meta-llama/Llama-2-7b-hf config.json (the keys the planner reads)
LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
              "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 32, "tie_word_embeddings": False,
              "torch_dtype": "float16", "vocab_size": 32000}


def test_base_comes_from_the_catalog(tmp_path: Path) -> None:
    model = load_one(tmp_path, base="Llama-2-13B")
    assert resolve_architecture(model) == BASE_MODELS["llama-2-13b"].architecture


def test_unknown_base_names_close_ones_at_its_line(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-13")
    model = load_one(tmp_path, base="llama-2-13")
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(model)
    [problem] = caught.value.problems
    assert problem.line == line_of(path, "base")
    assert "did you mean llama-2-13b" in problem.message


def test_remote_model_path_without_base_asks_for_base_or_architecture(tmp_path: Path) -> None:
    path = write_model(tmp_path, modelPath="s3://models/contract-v2.gguf")
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(load_one(tmp_path, modelPath="s3://models/contract-v2.gguf"))
    [problem] = caught.value.problems
    assert problem.line == line_of(path, "modelPath")
    assert "give base:" in problem.message and "architecture:" in problem.message


def test_base_and_architecture_together_is_an_error(tmp_path: Path) -> None:
    arch = {"parameters": "7B", "layers": 32, "hidden_size": 4096, "attention_heads": 32,
            "max_position": 4096}
    path = write_model(tmp_path, base="llama-2-7b", architecture=arch)
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(load_one(tmp_path, base="llama-2-7b", architecture=arch))
    assert caught.value.problems[0].line == line_of(path, "architecture")


def test_config_json_directory_relative_to_the_model_file(tmp_path: Path) -> None:
    weights = tmp_path / "llama"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(LLAMA_2_7B), encoding="utf-8")
    arch = resolve_architecture(load_one(tmp_path, modelPath="llama"))
    assert (arch.layers, arch.hidden_size, arch.attention_heads, arch.kv_head_count, arch.max_position) == \
        (32, 4096, 32, 32, 4096)
    # Without a safetensors index the count is estimated from the shapes: within 1% of the
    # 6,738,415,616 parameters of the published checkpoint.
    assert arch.parameter_count == pytest.approx(6_738_415_616, rel=0.01)


def test_safetensors_index_gives_the_exact_parameter_count(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B), encoding="utf-8")
    # model.safetensors.index.json of meta-llama/Llama-2-7b-hf: total_size 13,476,839,424 bytes of fp16
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 13_476_839_424}, "weight_map": {}}), encoding="utf-8")
    assert read_hf_config(str(tmp_path / "config.json")).parameter_count == 6_738_419_712


def test_estimate_parameters_counts_gqa_and_tied_embeddings() -> None:
    # Llama-3-8B: 8,030,261,248 published; GQA with 8 KV heads, intermediate 14336, vocab 128256
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "num_hidden_layers": 32, "vocab_size": 128256, "hidden_act": "silu"}
    assert estimate_parameters(config) == pytest.approx(8_030_261_248, rel=0.001)


def test_gguf_header_is_read(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", layers=2, hidden=64, heads=8, kv_heads=2, context=4096)
    arch = resolve_architecture(load_one(tmp_path, modelPath="tiny.gguf", quantization="q4_k_m"))
    assert (arch.layers, arch.hidden_size, arch.attention_heads, arch.kv_head_count, arch.max_position) == \
        (2, 64, 8, 2, 4096)
    assert arch.parameter_count == 1000 * 1024
    assert arch.vocab_size == 3


LOCAL_ERRORS = [
    ("missing file", "absent.gguf", None, "no such file"),
    ("not a GGUF", "bad.gguf", b"not gguf at all", "not a readable GGUF file"),
    ("config without layers", "cfg/config.json", json.dumps({"hidden_size": 8}).encode(),
     "num_hidden_layers"),
    ("config not JSON", "cfg/config.json", b"{", "cannot read it as JSON"),
]


@pytest.mark.parametrize(("rel", "content", "words"), [c[1:] for c in LOCAL_ERRORS],
                         ids=[c[0] for c in LOCAL_ERRORS])
def test_unreadable_local_model_is_an_error_at_model_path(tmp_path: Path, rel: str, content: bytes | None,
                                                          words: str) -> None:
    if content is not None:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    path = write_model(tmp_path, modelPath=rel)
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(load_one(tmp_path, modelPath=rel))
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), line_of(path, "modelPath"))
    assert words in problem.message


BAD_CONFIGS: list[tuple[str, dict[str, object], str]] = [
    ("no attention heads", {**LLAMA_2_7B, "num_attention_heads": 0},
     "num_attention_heads is 0, not a head count"),
    ("a 400-digit intermediate size", {**LLAMA_2_7B, "intermediate_size": int("9" * 400)},
     "is too large: at most 1000T"),
    ("heads as true", {**LLAMA_2_7B, "num_attention_heads": True}, "no integer num_attention_heads"),
]


@pytest.mark.parametrize(("config", "words"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_config_json_that_cannot_be_sized_is_an_error_at_model_path(
        tmp_path: Path, config: dict[str, object], words: str) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(config), encoding="utf-8")
    path = write_model(tmp_path, modelPath="weights")
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(load_one(tmp_path, modelPath="weights"))
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), line_of(path, "modelPath"))
    assert problem.message.startswith(f"{weights / 'config.json'}: ") and words in problem.message, \
        problem.message


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # opening it to read would wait for a writer forever


def _big(path: Path) -> None:
    path.write_text(json.dumps({**LLAMA_2_7B, "pad": "x" * (1 << 20)}), encoding="utf-8")


def _latin1(path: Path) -> None:
    path.write_bytes(json.dumps({**LLAMA_2_7B, "name": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))


def _not_json(path: Path) -> None:
    path.write_text("[" * 100_000, encoding="utf-8")  # nested past the recursion limit


@pytest.mark.parametrize(("write", "words"), [
    (_fifo, "not a regular file"), (_big, "more than the 1048576 read"), (_latin1, "not UTF-8 text"),
    (_not_json, "cannot read it as JSON")], ids=["fifo", "above 1 MiB", "latin-1", "not JSON"])
def test_a_config_json_that_cannot_be_read_is_an_error_at_model_path(
        tmp_path: Path, write: Callable[[Path], None], words: str) -> None:
    config = tmp_path / "config.json"
    write(config)
    path = write_model(tmp_path, modelPath="config.json")
    with pytest.raises(ConfigError) as caught:
        resolve_architecture(load_one(tmp_path, modelPath="config.json"))
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), line_of(path, "modelPath"))
    assert words in problem.message, problem.message
