"""The built-in GPU and model catalogs, and the ``--gpus FILE`` that extends them."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmmodel.catalog import BASE_MODELS, BUILTIN_GPUS, GIB, default_inventory, load_gpus
from llmmodel.sizing import kv_bytes_per_token
from routing.errors import ConfigError

SPEC_SHEET = [
    # name, memory GiB (nvidia-smi), CC, bandwidth GB/s: NVIDIA data sheets
    ("A100-40GB", 40.0, (8, 0), 1555), ("A100-80GB", 80.0, (8, 0), 2039),
    ("H100-80GB", 79.6, (9, 0), 3350), ("H200", 140.4, (9, 0), 4800), ("L40S", 45.0, (8, 9), 864),
    ("A10G", 22.5, (8, 6), 600), ("L4", 22.5, (8, 9), 300), ("T4-16GB", 15.0, (7, 5), 320),
    ("V100-32GB", 32.0, (7, 0), 900),
]


@pytest.mark.parametrize(("name", "gib", "cc", "bandwidth"), SPEC_SHEET)
def test_builtin_gpus_carry_spec_sheet_figures(name: str, gib: float, cc: tuple[int, int],
                                               bandwidth: int) -> None:
    gpu = BUILTIN_GPUS[name]
    assert gpu.memory_gib == pytest.approx(gib, abs=0.1)
    assert gpu.compute_capability == cc
    assert gpu.bandwidth_gbps == bandwidth
    assert gpu.power_w > 0 and gpu.tflops_fp16 > 0 and gpu.cost_per_hour


def test_default_inventory_is_every_gpu_on_nodes_of_8_with_4_per_numa() -> None:
    inventory = default_inventory()
    assert {g.name for g in inventory.usable()} == set(BUILTIN_GPUS)
    assert all((n.count, n.gpus_per_numa_node) == (8, 4) for n in inventory.nodes.values())
    assert load_gpus(None) == inventory


def test_usable_is_cheapest_first() -> None:
    costs = [g.cost_per_hour or 0.0 for g in default_inventory().usable()]
    assert costs == sorted(costs)


def test_llama_2_13b_kv_per_token_is_800_kib() -> None:
    # 2 (K, V) x 40 layers x 40 KV heads x 128 head dim x 2 bytes (config.json of meta-llama/Llama-2-13b-hf)
    assert kv_bytes_per_token(BASE_MODELS["llama-2-13b"].architecture, 2) == 819_200 == 800 * 1024


def test_catalog_models_have_their_config_json_shapes() -> None:
    assert BASE_MODELS["llama-3.1-8b"].architecture.max_position == 131072
    assert BASE_MODELS["llama-3-8b"].architecture.kv_head_count == 8
    bge = BASE_MODELS["bge-m3"].architecture
    assert (bge.layers, bge.hidden_size, bge.attention_heads, bge.max_position) == (24, 1024, 16, 8192)


def test_gpus_file_adds_and_overrides_classes_and_limits_nodes(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "gpus:\n"
        "  - {name: MI300X, memory: 192Gi, compute_capability: \"9.4\", bandwidth_gbps: 5300, power_w: 750}\n"
        "  - {name: A100-80GB, cost_per_hour: 2.5}\n"
        "nodes:\n"
        "  - {gpu: A100-80GB, count: 8, gpus_per_numa_node: 2, power_budget_w: 3500}\n"
        "  - {gpu: MI300X}\n", encoding="utf-8")
    inventory = load_gpus(str(path))
    assert [g.name for g in inventory.usable()] == ["A100-80GB", "MI300X"]  # the unpriced one last
    mi300x = inventory.classes["MI300X"]
    assert (mi300x.memory_bytes, mi300x.compute_capability) == (192 * GIB, (9, 4))
    assert inventory.classes["A100-80GB"].memory_bytes == BUILTIN_GPUS["A100-80GB"].memory_bytes
    assert inventory.classes["A100-80GB"].cost_per_hour == 2.5
    assert inventory.node("A100-80GB").gpus_per_numa_node == 2
    assert inventory.node("A100-80GB").power_budget_w == 3500
    assert inventory.node("MI300X").gpus_per_numa_node == 4


GPU_FILE_ERRORS = [
    ("unknown key", "gpus:\n  - name: X1\n    memory: 80Gi\n    flops: 3\n", 4, "unknown key 'flops'"),
    ("bad compute capability", "gpus:\n  - name: X1\n    memory: 80Gi\n    compute_capability: nine\n"
                               "    bandwidth_gbps: 100\n", 4, "MAJOR.MINOR"),
    ("new GPU without memory", "gpus:\n  - name: X1\n    compute_capability: \"8.0\"\n"
                               "    bandwidth_gbps: 100\n", 2, "needs memory"),
    ("node of an unknown GPU", "nodes:\n  - gpu: A100-80GB\n  - gpu: B200\n", 3, "unknown GPU 'B200'"),
    ("NUMA larger than node", "nodes:\n  - gpu: L4\n    count: 2\n    gpus_per_numa_node: 4\n", 4,
     "4 GPUs per NUMA node on a node of 2"),
    ("not a mapping", "- A100\n", 1, "a --gpus file is a mapping"),
]


@pytest.mark.parametrize(("text", "line", "words"), [c[1:] for c in GPU_FILE_ERRORS],
                         ids=[c[0] for c in GPU_FILE_ERRORS])
def test_gpus_file_errors_name_file_and_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_gpus(str(path))
    assert [(p.file, p.line) for p in caught.value.problems] == [(str(path), line)], str(caught.value)
    assert words in str(caught.value)


def test_missing_gpus_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_gpus(str(tmp_path / "absent.yaml"))
