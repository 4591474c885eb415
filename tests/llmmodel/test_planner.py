"""The rules every plan keeps, checked on the plans the planner makes, and its memory formula
checked against what vLLM itself logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmmodel.catalog import BASE_MODELS, BUILTIN_GPUS, GIB, default_inventory, load_gpus
from llmmodel.planner import plan_model, plan_models, pool_label
from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.sizing import (
    kv_bytes_per_token_per_gpu,
    kv_capacity_tokens,
    overhead_bytes,
    weights_bytes,
)
from llmmodel.spec import load_models
from routing.errors import ConfigError
from tests.llmmodel.fixtures.models import line_of, load_one, write_gguf, write_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


def _arg(pool: PoolPlan, flag: str) -> str:
    args = list(pool.vllm_args)
    return args[args.index(flag) + 1]


def _fits(pool: PoolPlan, model: ModelPlan) -> None:
    """Weights + overhead + the promised KV cache fit the memory vLLM is granted on each GPU,
    and that grant is within gpuRequest / GPUs."""
    arch = _arch(model)
    tp = pool.tensor_parallel_size
    element = 1 if pool.kv_cache_dtype == "fp8" else 2
    granted = pool.gpu_memory_utilization * pool.gpu_memory_bytes
    used = (pool.weights_bytes / tp + overhead_bytes(arch, pool.max_num_batched_tokens)
            + pool.kv_cache_tokens * kv_bytes_per_token_per_gpu(arch, element, tp))
    assert used <= granted, (pool.name, used / GIB, granted / GIB)
    assert granted <= model.model.spec.gpu_request_bytes / tp
    assert pool.gpu_memory_utilization <= 0.95
    assert pool.max_concurrent_sequences == pool.kv_cache_tokens // pool.context >= 1


def _arch(model: ModelPlan) -> Any:
    spec = model.model.spec
    return spec.architecture or BASE_MODELS[str(spec.base)].architecture


def test_field_notes_example_gives_two_pools_that_fit() -> None:
    [plan] = plan_models(load_models([str(EXAMPLES / "contract-review.yaml")]), default_inventory())
    assert [p.name for p in plan.pools] == ["contract-review-v2-2k", "contract-review-v2-4k"]
    assert [p.context for p in plan.pools] == [2048, 4096]
    for pool in plan.pools:
        _fits(pool, plan)
        assert _arg(pool, "--max-model-len") == str(pool.context)
        assert pool.max_concurrent_sequences >= 2
        assert set(pool.reasons) >= {f for f in pool.vllm_args if f.startswith("--enable")
                                     or f in ("--max-model-len", "--tensor-parallel-size", "--block-size",
                                              "--gpu-memory-utilization", "--kv-cache-dtype",
                                              "--max-num-seqs", "--max-num-batched-tokens")}
    # 13B fp16 = 24.24 GiB of weights: the reason shows the arithmetic it rests on
    assert "weights 24.24 GiB" in plan.pools[0].reasons["--gpu-memory-utilization"]
    assert "819200 B per token" in plan.pools[0].reasons["--kv-cache-dtype"]


def test_kv_capacity_matches_vllm_startup_log() -> None:
    """vLLM 0.10.2 start-up log, llava-hf/llava-v1.6-mistral-7b-hf (Mistral-7B language model:
    32 layers, 8 KV heads of 128) on an 80 GB GPU, --gpu-memory-utilization 0.9, chunked
    prefill with max_num_batched_tokens=16384, block size 16:

        Free memory on device (78.66/79.19 GiB) on startup. Desired GPU memory utilization is
        (0.9, 71.27 GiB). Actual usage is 14.08 GiB for weight, 1.97 GiB for peak activation,
        0.07 GiB for non-torch memory, and 0.67 GiB for CUDAGraph memory.
        Available KV cache memory: 55.15 GiB
        GPU KV cache size: 451,744 tokens

    (a public log found in the code corpus; the log line format is vLLM's own, see
    https://github.com/vllm-project/vllm/pull/13596). Our formula, with the catalog's
    Mistral-7B (text weights only, no vision tower), gives 448,768 tokens: 0.7% under vLLM's
    figure (asserted within 2%)."""
    arch = BASE_MODELS["mistral-7b"].architecture
    granted = int(0.9 * 79.19 * GIB)
    tokens = kv_capacity_tokens(granted, weights_bytes(arch, "fp16"), overhead_bytes(arch, 16384),
                                kv_bytes_per_token_per_gpu(arch, 2, 1), 16)
    assert tokens == pytest.approx(451_744, rel=0.02)
    # and the per-token figure vLLM divides by: 55.15 GiB / 451,744 tokens = 128 KiB
    assert kv_bytes_per_token_per_gpu(arch, 2, 1) == 131_072
    per_token_logged = 55.15 * GIB / 451_744
    assert per_token_logged == pytest.approx(131_072, rel=0.001)


@pytest.mark.parametrize("gpu", ["T4-16GB", "V100-32GB", "A10G", "A100-40GB", "L40S", "H100-80GB"])
@pytest.mark.parametrize("request_gib", [16, 20, 28, 40, 60])
def test_fp8_kv_cache_only_from_compute_capability_8_0(tmp_path: Path, gpu: str, request_gib: int) -> None:
    model = load_one(tmp_path, base="llama-2-13b", gpuClass=gpu, gpuRequest=f"{request_gib}Gi",
                     contexts=[4096], sla={"p99Latency": "5s"})
    try:
        plan = plan_model(model, default_inventory())
    except ConfigError as err:
        assert len(err.problems) == 1
        return
    for pool in plan.pools:
        _fits(pool, plan)
        if BUILTIN_GPUS[gpu].compute_capability < (8, 0):
            assert pool.kv_cache_dtype == "auto" and _arg(pool, "--kv-cache-dtype") == "auto"


def test_fp8_kv_is_chosen_when_16_bit_kv_does_not_hold_the_pool(tmp_path: Path) -> None:
    # 30Gi on an A100-40GB for 13B fp16: 24.24 GiB of weights and 1.63 GiB of overhead leave
    # 4.1 GiB, under the 6.25 GiB two 4K sequences need in fp16, over the 3.13 GiB they need in fp8
    model = load_one(tmp_path, base="llama-2-13b", gpuClass="A100-40GB", gpuRequest="30Gi",
                     contexts=[4096], sla={"p99Latency": "5s"})
    [pool] = plan_model(model, default_inventory()).pools
    assert pool.kv_cache_dtype == "fp8"
    assert "compute capability 8.0" in pool.reasons["--kv-cache-dtype"]
    # the same grant on a V100 (CC 7.0) cannot use FP8: refused instead
    path = write_model(tmp_path, "v100", base="llama-2-13b", gpuClass="V100-32GB", gpuRequest="30Gi",
                       contexts=[4096], sla={"p99Latency": "5s"})
    with pytest.raises(ConfigError) as caught:
        plan_model(load_models([str(path)])[0], default_inventory())
    assert [p.line for p in caught.value.problems] == [line_of(path, "gpuRequest")]


def _gpus_file(tmp_path: Path, *nodes: str) -> str:
    path = tmp_path / "gpus.yaml"
    path.write_text("nodes:\n" + "".join(f"  - {{gpu: {n}, count: 8, gpus_per_numa_node: 2}}\n"
                                          for n in nodes), encoding="utf-8")
    return str(path)


def test_tensor_parallelism_never_spans_a_numa_node(tmp_path: Path) -> None:
    # 70B fp16 = 128 GiB of weights: 4 A100-80GB, but the nodes have 2 GPUs per NUMA node
    path = write_model(tmp_path, "big", base="llama-2-70b", gpuRequest="200Gi", contexts=[4096],
                       sla={"p99Latency": "2s"})
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), load_gpus(_gpus_file(tmp_path, "A100-80GB")))
    [problem] = caught.value.problems
    assert (problem.file, problem.line) == (str(path), line_of(path, "gpuRequest"))
    assert "a NUMA node has 2" in problem.message
    # with H200s too, it is put on 2 of them: bigger GPUs, still inside a NUMA node
    [plan] = plan_models(load_models([str(path)]), load_gpus(_gpus_file(tmp_path, "A100-80GB", "H200")))
    [pool] = plan.pools
    assert (pool.gpu_class, pool.tensor_parallel_size) == ("H200", 2)
    _fits(pool, plan)


@pytest.mark.parametrize("base", ["llama-2-7b", "llama-2-13b", "llama-2-70b", "mixtral-8x7b", "qwen2.5-72b"])
def test_tensor_parallel_size_is_at_most_the_numa_node_and_divides_heads(tmp_path: Path, base: str) -> None:
    model = load_one(tmp_path, base=base, gpuRequest="150Gi", contexts=[4096], sla={"p99Latency": "5s"})
    inventory = default_inventory()
    for pool in plan_model(model, inventory).pools:
        arch = BASE_MODELS[base].architecture
        assert pool.tensor_parallel_size <= inventory.node(pool.gpu_class).gpus_per_numa_node
        assert arch.attention_heads % pool.tensor_parallel_size == 0
        assert _arg(pool, "--tensor-parallel-size") == str(pool.tensor_parallel_size)


def test_weights_too_big_for_any_numa_node_is_one_error_at_base(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="qwen2.5-72b", gpuRequest="400Gi", contexts=[4096],
                       sla={"p99Latency": "5s"})
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), load_gpus(_gpus_file(tmp_path, "A100-40GB", "L4")))
    assert [(p.file, p.line) for p in caught.value.problems] == [(str(path), line_of(path, "base"))]
    assert "fits no GPU" in caught.value.problems[0].message


def test_request_below_the_weights_is_one_error_at_gpu_request(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-13b", gpuRequest="20Gi")
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), default_inventory())
    [problem] = caught.value.problems
    assert problem.line == line_of(path, "gpuRequest")
    assert "24.24 GiB of fp16 weights" in problem.message


def test_unreachable_ttft_is_an_error_at_the_sla(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-70b", gpuRequest="150Gi", sla={"p99Latency": "5ms"})
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), default_inventory())
    [problem] = caught.value.problems
    assert problem.line == line_of(path, "sla")
    assert "P99 TTFT" in problem.message


def test_a_64k_pool_runs_one_sequence_without_chunked_prefill(tmp_path: Path) -> None:
    model = load_one(tmp_path, base="llama-3.1-8b", gpuRequest="60Gi", contexts=[8192, 65536],
                     sla={"p99Latency": "1s"})
    plan = plan_model(model, default_inventory())
    short, long = plan.pools
    assert long.name == "m-64k" and long.max_num_seqs == 1 and _arg(long, "--max-num-seqs") == "1"
    assert not long.enable_chunked_prefill and "--no-enable-chunked-prefill" in long.vllm_args
    assert long.max_num_batched_tokens >= 65536  # vLLM requires the whole prompt in one step
    assert short.enable_chunked_prefill and "--enable-chunked-prefill" in short.vllm_args
    assert short.max_num_seqs > 1
    for pool in plan.pools:
        _fits(pool, plan)


def test_context_above_max_position_is_an_error_at_that_context(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-13b", contexts=[2048, 8192])
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), default_inventory())
    [problem] = caught.value.problems
    assert problem.line == line_of(path, "contexts")
    assert "context 8192 is above the model's longest (4096" in problem.message


@pytest.mark.parametrize(("max_position", "contexts"), [(4096, [2048, 4096]), (2048, [2048]),
                                                        (1024, [1024]), (131072, [2048, 131072])])
def test_default_contexts_are_2048_and_the_longest(tmp_path: Path, max_position: int,
                                                   contexts: list[int]) -> None:
    arch = {"parameters": "1B", "layers": 16, "hidden_size": 2048, "attention_heads": 16, "kv_heads": 4,
            "max_position": max_position}
    plan = plan_model(load_one(tmp_path, architecture=arch, gpuRequest="70Gi", sla={"p99Latency": "2s"}),
                      default_inventory())
    assert [p.context for p in plan.pools] == contexts
    assert [p.name for p in plan.pools] == [f"m-{pool_label(c)}" for c in contexts]


def test_pool_labels() -> None:
    assert [pool_label(c) for c in (2048, 4096, 32768, 3000)] == ["2k", "4k", "32k", "3000"]


def test_canary_pool_unless_another_model_serves_it(tmp_path: Path) -> None:
    canary = {"model": "contract-review-v3", "percent": 5, "modelPath": "hf://org/v3"}
    model = load_one(tmp_path, "contract-review-v2", base="llama-2-13b", canary=canary)
    plan = plan_model(model, default_inventory())
    assert [p.name for p in plan.pools] == ["contract-review-v2-2k", "contract-review-v2-4k",
                                            "contract-review-v2-canary"]
    canary_pool, longest = plan.pools[2], plan.pools[1]
    assert (canary_pool.serves, canary_pool.model_path, canary_pool.context) == \
        ("contract-review-v3", "hf://org/v3", longest.context)
    assert canary_pool.vllm_args[-2:] == ("--served-model-name", "contract-review-v3")
    assert canary_pool.vllm_args[:-1] == longest.vllm_args[:-1]
    assert [p.name for p in plan.serving_pools] == ["contract-review-v2-2k", "contract-review-v2-4k"]
    declared = plan_model(model, default_inventory(), declared={"contract-review-v3"})
    assert [p.name for p in declared.pools] == ["contract-review-v2-2k", "contract-review-v2-4k"]


def test_embedding_model_runs_the_pooling_runner_without_prefix_caching() -> None:
    [plan] = plan_models(load_models([str(EXAMPLES / "bge-m3.yaml")]), default_inventory())
    assert plan.kind == "embedding"
    for pool in plan.pools:
        assert _arg(pool, "--runner") == "pooling"
        assert "--no-enable-prefix-caching" in pool.vllm_args and not pool.enable_prefix_caching
        assert "--no-enable-chunked-prefill" in pool.vllm_args
        assert pool.max_num_batched_tokens >= pool.context
        _fits(pool, plan)


QUANT_FLAGS = [("fp16", None), ("bf16", None), ("fp8", "fp8"), ("awq", "awq"), ("gptq", "gptq"),
               ("int8", None)]


@pytest.mark.parametrize(("quant", "flag"), QUANT_FLAGS)
def test_quantization_flag_and_weight_size(tmp_path: Path, quant: str, flag: str | None) -> None:
    plan = plan_model(load_one(tmp_path, base="llama-2-13b", quantization=quant, contexts=[4096]),
                      default_inventory())
    [pool] = plan.pools
    assert (_arg(pool, "--quantization") if "--quantization" in pool.vllm_args else None) == flag
    bits = {"fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "awq": 4.5, "gptq": 4.5}[quant]
    assert pool.weights_bytes == pytest.approx(13_015_864_320 * bits / 8, abs=1)
    if quant in ("bf16", "fp8"):
        assert BUILTIN_GPUS[pool.gpu_class].compute_capability >= (8, 0)


def test_gguf_model_gets_the_base_tokenizer_and_llama_cpp_bits(tmp_path: Path) -> None:
    plan = plan_model(load_one(tmp_path, base="llama-2-13b", quantization="q4_k_m",
                               modelPath="s3://models/contract-v2.gguf"), default_inventory())
    for pool in plan.pools:
        assert _arg(pool, "--tokenizer") == "meta-llama/Llama-2-13b-hf"
        assert "--quantization" not in pool.vllm_args
        assert pool.weights_bytes == pytest.approx(13_015_864_320 * 4.85 / 8, abs=1)


def test_local_gguf_is_planned_from_its_header(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", layers=2, hidden=64, heads=8, kv_heads=2, context=4096)
    plan = plan_model(load_one(tmp_path, modelPath="tiny.gguf", quantization="q8_0", gpuRequest="2Gi"),
                      default_inventory())
    assert [p.context for p in plan.pools] == [2048, 4096]
    assert plan.pools[0].kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # 2 x layers x kv heads x head dim 8 x 2


def test_power_cap_slows_the_planned_prefill(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("nodes:\n  - {gpu: A100-80GB, count: 8, gpus_per_numa_node: 4, power_budget_w: 1600}\n",
                    encoding="utf-8")
    model = load_one(tmp_path, base="llama-2-13b", contexts=[4096], sla={"p99Latency": "1s"})
    [capped] = plan_model(model, load_gpus(str(gpus))).pools
    uncapped = plan_model(model, load_gpus(_gpus_file(tmp_path, "A100-80GB"))).pools[0]
    assert capped.prefill_ms_per_token == pytest.approx(uncapped.prefill_ms_per_token * 2, rel=0.01)
    assert "200 W per GPU of 400 W" in capped.reasons["--tensor-parallel-size"]


def test_decode_speed_is_weights_over_bandwidth(tmp_path: Path) -> None:
    model = load_one(tmp_path, base="llama-2-13b", gpuClass="A100-80GB", contexts=[4096])
    [pool] = plan_model(model, default_inventory()).pools
    # 26.03 GB of weights read once per step at 2039 GB/s = 12.77 ms
    assert pool.decode_ms_per_token == pytest.approx(13_015_864_320 * 2 / 2039e9 * 1000, abs=0.001)


def test_plan_models_collects_every_models_problem(tmp_path: Path) -> None:
    a = write_model(tmp_path, "a", base="llama-2-13x")
    b = write_model(tmp_path, "b", base="llama-2-13b", gpuRequest="4Gi")
    c = write_model(tmp_path, "c", base="llama-2-7b")
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(a), str(b), str(c)]), default_inventory())
    assert [(p.file, p.line) for p in caught.value.problems] == [
        (str(a), line_of(a, "base")), (str(b), line_of(b, "gpuRequest"))]


def test_unknown_gpu_class_is_an_error_at_gpu_class(tmp_path: Path) -> None:
    path = write_model(tmp_path, base="llama-2-13b", gpuClass="B200")
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(path)]), default_inventory())
    assert [p.line for p in caught.value.problems] == [line_of(path, "gpuClass")]
    assert "not in the inventory" in str(caught.value)


def test_plans_are_deterministic_and_rounded(tmp_path: Path) -> None:
    models = load_models([str(EXAMPLES)])
    first = json.dumps([p.as_json() for p in plan_models(models, default_inventory())])
    second = json.dumps([p.as_json() for p in plan_models(load_models([str(EXAMPLES)]), default_inventory())])
    assert first == second
    for plan in plan_models(models, default_inventory()):
        for pool in plan.pools:
            util = _arg(pool, "--gpu-memory-utilization")
            assert len(util.split(".")[1]) == 2 and float(util) == pool.gpu_memory_utilization
            assert pool.block_size in (8, 16, 32)
            assert 1 <= pool.max_num_seqs <= 256


def _canary_models(tmp_path: Path, *specs: tuple[str, dict[str, Any]]) -> list[Path]:
    return [write_model(tmp_path, name, base="llama-2-7b", **spec) for name, spec in specs]


def _plan_problems(paths: list[Path]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        plan_models(load_models([str(p) for p in paths]), default_inventory())
    return [str(p) for p in caught.value.problems]


def test_naming_a_model_of_its_own_as_canary_is_refused(tmp_path: Path) -> None:
    """Without the canary's consent, `victim` would vanish from models: (its clients: 404)."""
    victim, attacker = _canary_models(tmp_path, ("victim", {}),
                                      ("attacker", {"canary": {"model": "victim", "percent": 1}}))
    assert _plan_problems([victim, attacker]) == [
        f"{attacker}:{line_of(attacker, 'canary')}: 'victim' is served as a model "
        "of its own; to make it this model's canary, set canaryOf: attacker in its LLMModel"]


def test_a_mutual_canary_is_refused_on_both_sides(tmp_path: Path) -> None:
    a, b = _canary_models(tmp_path, ("a", {"canary": {"model": "b", "percent": 5}}),
                          ("b", {"canary": {"model": "a", "percent": 5}}))
    found = _plan_problems([a, b])
    assert [p.split(": ")[0] for p in found] == [f"{a}:{line_of(a, 'canary')}", f"{b}:{line_of(b, 'canary')}"]
    assert all("is served as a model of its own" in p for p in found)


def test_a_canary_that_opts_in_gets_no_canary_pool_of_the_stable_model(tmp_path: Path) -> None:
    stable, canary = _canary_models(tmp_path, ("v2", {"canary": {"model": "v3", "percent": 5}}),
                                    ("v3", {"canaryOf": "v2"}))
    plans = {p.name: p for p in plan_models(load_models([str(stable), str(canary)]), default_inventory())}
    assert [p.name for p in plans["v2"].pools] == ["v2-2k", "v2-4k"]
    assert [p.name for p in plans["v3"].pools] == ["v3-2k", "v3-4k"]


def test_canary_of_a_model_that_names_another_canary_is_refused(tmp_path: Path) -> None:
    stable, canary = _canary_models(tmp_path, ("v2", {"canary": {"model": "v4", "percent": 5}}),
                                    ("v3", {"canaryOf": "v2"}))
    assert _plan_problems([stable, canary]) == [
        f"{canary}:{line_of(canary, 'canaryOf')}: 'v2' does not name 'v3' as its canary "
        "(names 'v4'): set canary: {model: v3, percent: ...} in its LLMModel, or remove canaryOf"]


def test_canary_of_a_canary_is_refused(tmp_path: Path) -> None:
    paths = _canary_models(tmp_path, ("v2", {"canary": {"model": "v3", "percent": 5}}),
                           ("v3", {"canaryOf": "v2"}), ("v4", {"canaryOf": "v3"}))
    assert _plan_problems(paths) == [
        f"{paths[2]}:{line_of(paths[2], 'canaryOf')}: 'v3' is itself the canary of 'v2': "
        "a canary's stable model is a model served on its own"]
