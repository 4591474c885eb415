"""The planner: from an LLMModel, its architecture and the GPU inventory, every pool's GPUs and
vLLM flags, each flag with the reason it has its value. Pure: no I/O beyond reading a local
model's ``config.json`` or GGUF header (:mod:`llmmodel.arch`). This module chooses the GPU class
and tensor parallelism of each pool from the memory model of :mod:`llmmodel.sizing`;
:mod:`llmmodel.flags` turns each choice into the pool's vLLM flags and their reasons.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal

from llmmodel.arch import resolve_architecture
from llmmodel.catalog import GpuClass, GpuInventory
from llmmodel.flags import pool_plan
from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.sizing import (
    CHUNK_RANGE,
    FIXED_OVERHEAD,
    MAX_UTILIZATION,
    MFU,
    MIN_CC,
    TYPICAL_PROMPT,
    Fit,
    PoolNeed,
    block_size,
    gib,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    kv_capacity_tokens,
    overhead_bytes,
)
from llmmodel.spec import Architecture, LoadedModel, canary_problems
from routing.errors import ConfigError, Problem


@dataclass(frozen=True)
class _Miss:
    kind: Literal["grant", "numa", "ttft", "cc", "heads"]
    text: str


def pool_label(context: int) -> str:
    """``2k`` for 2048, ``32k`` for 32768, the number itself when not a multiple of 1024."""
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _speeds(pool: PoolNeed, gpu: GpuClass, tp: int, power_ratio: float) -> tuple[float, float]:
    """(prefill ms per token, decode ms per step) on ``tp`` GPUs of ``gpu``: prefill is
    compute-bound (2 x parameters FLOPs per token at :data:`MFU`), decode memory-bound (every
    weight read once per step)."""
    flops = gpu.tflops_fp16 * 1e12 * tp * MFU * power_ratio
    prefill = 2 * pool.arch.parameter_count / flops * 1000
    decode = pool.weights / tp / (gpu.bandwidth_gbps * 1e9) * 1000
    return prefill, decode


def _batched(pool: PoolNeed, prefill_ms: float) -> int:
    budget = pool.p99_ms / 2 / prefill_ms
    chunk = 1 << max(0, int(math.log2(max(budget, 1))))
    chunk = min(max(chunk, CHUNK_RANGE[0]), CHUNK_RANGE[1])
    if pool.embedding:
        return max(pool.context, CHUNK_RANGE[1])
    return pool.context if pool.long else min(chunk, max(pool.context, CHUNK_RANGE[0]))


def _try_gpu(pool: PoolNeed, gpu: GpuClass, inventory: GpuInventory) -> Fit | _Miss:
    """The smallest tensor-parallel size on ``gpu`` that holds the pool, or why none does."""
    need_cc = MIN_CC.get(pool.quantization)
    if need_cc and gpu.compute_capability < need_cc:
        return _Miss("cc", f"{pool.quantization} needs compute capability {need_cc[0]}.{need_cc[1]}, "
                           f"it has {gpu.cc_text}")
    node = inventory.node(gpu.name)
    numa = min(node.gpus_per_numa_node, node.count)
    power_ratio, power_note = 1.0, ""
    if node.power_budget_w and gpu.power_w:
        per_gpu = node.power_budget_w / node.count
        if per_gpu < gpu.power_w:
            power_ratio = per_gpu / gpu.power_w
            power_note = (f"; nodes capped at {node.power_budget_w} W for {node.count} GPUs = "
                          f"{per_gpu:.0f} W per GPU of {gpu.power_w} W TDP, so prefill is planned at "
                          f"{power_ratio:.0%} speed")
    arch = pool.arch
    miss = _Miss("numa", f"{gib(pool.granted)} needs more than {numa} GPU(s) of {gpu.memory_gib:.1f} GiB "
                         f"at {MAX_UTILIZATION:.0%} and a NUMA node has {numa}")
    tp = 1
    while tp <= numa:
        heads_ok = arch.attention_heads % tp == 0 and (
            arch.kv_head_count % tp == 0 or tp % arch.kv_head_count == 0)
        per_gpu = pool.granted // tp
        if not heads_ok:
            miss = _Miss("heads", f"{tp} GPUs do not divide {arch.attention_heads} attention heads")
        elif per_gpu <= MAX_UTILIZATION * gpu.memory_bytes:
            found = _fit_at(pool, gpu, tp, power_ratio, power_note)
            if isinstance(found, Fit) or found.kind == "grant":
                return found
            miss = found
        tp *= 2
    return miss


def _fit_at(pool: PoolNeed, gpu: GpuClass, tp: int, power_ratio: float, power_note: str) -> Fit | _Miss:
    utilization = math.floor(pool.granted / tp / gpu.memory_bytes * 100) / 100
    granted = int(utilization * gpu.memory_bytes)
    prefill, decode = _speeds(pool, gpu, tp, power_ratio)
    batched = _batched(pool, prefill)
    overhead = overhead_bytes(pool.arch, batched)
    weights = math.ceil(pool.weights / tp)
    dtypes: list[Literal["auto", "fp8"]] = ["auto", "fp8"] if gpu.compute_capability >= (8, 0) else ["auto"]
    tokens = 0
    for dtype in dtypes:
        element = 1 if dtype == "fp8" else 2
        tokens = kv_capacity_tokens(granted, weights, overhead,
                                    kv_bytes_per_token_per_gpu(pool.arch, element, tp), pool.block)
        if tokens // pool.context >= pool.required:
            prompt = min(pool.context, TYPICAL_PROMPT)
            ttft = prompt * prefill
            if ttft > pool.p99_ms:
                return _Miss("ttft", f"a {prompt}-token prompt takes {ttft:.0f} ms to prefill on {tp} "
                                     f"GPU(s), above the {pool.p99_ms:.0f} ms P99 TTFT")
            return Fit(gpu, tp, utilization, dtype, tokens, batched, overhead, prefill, decode, ttft,
                        power_note)
    need = pool.required * pool.context * kv_bytes_per_token_per_gpu(pool.arch, element, tp)
    return _Miss("grant", (f"{tp} GPU(s) at {gib(granted)} each hold weights {gib(weights)} + overhead "
                           f"{gib(overhead)}, leaving room for {tokens} KV tokens, not the "
                           f"{pool.required} x {pool.context} the pool needs ({gib(need)} more per GPU "
                           f"at most)"))


def _choose(pool: PoolNeed, model: LoadedModel, inventory: GpuInventory) -> Fit | ConfigError:
    spec = model.spec
    if spec.gpu_class is not None:
        if spec.gpu_class not in inventory.classes or spec.gpu_class not in inventory.nodes:
            there = ", ".join(g.name for g in inventory.usable())
            return model.error(("spec", "gpuClass"), f"GPU class {spec.gpu_class!r} is not in the inventory "
                                                     f"({inventory.source}: {there})")
        candidates = [inventory.classes[spec.gpu_class]]
    else:
        candidates = inventory.usable()
    fits: list[Fit] = []
    misses: list[tuple[str, _Miss]] = []
    for gpu in candidates:
        found = _try_gpu(pool, gpu, inventory)
        if isinstance(found, Fit):
            fits.append(found)
        else:
            misses.append((gpu.name, found))
    if fits:
        return min(fits, key=lambda f: (f.gpu.cost_per_hour is None, (f.gpu.cost_per_hour or 0) * f.tp,
                                        f.tp, f.gpu.name))
    return _refusal(pool, model, inventory, misses)


def _refusal(pool: PoolNeed, model: LoadedModel, inventory: GpuInventory,
             misses: list[tuple[str, _Miss]]) -> ConfigError:
    kinds = {miss.kind for _, miss in misses}
    spec = model.spec
    kv_need = pool.required * pool.context * kv_bytes_per_token(pool.arch, 2)
    summary = (f"pool {model.name}-{pool_label(pool.context)} fits no GPU of the {inventory.source} within "
               f"one NUMA node: it needs {gib(pool.weights)} of {pool.quantization} weights "
               f"({pool.arch.parameter_count / 1e9:.1f}B parameters) + {gib(FIXED_OVERHEAD)}+ overhead per "
               f"GPU + KV for {pool.required} sequence(s) of {pool.context} tokens ({gib(kv_need)} in fp16) "
               f"out of gpuRequest {gib(pool.granted)}; ")
    detail = "; ".join(f"{name}: {miss.text}" for name, miss in misses)
    if "ttft" in kinds:  # memory fits somewhere: the latency target is what nothing meets
        path: tuple[str, ...] = ("spec", "sla", "p99Latency")
    elif kinds <= {"numa", "cc", "heads"} and spec.gpu_class is None and _too_big(pool, inventory):
        path = ("spec", "architecture") if spec.architecture is not None else (
            ("spec", "base") if spec.base is not None else ("spec", "modelPath"))
    elif spec.gpu_class is not None and kinds <= {"cc", "heads"}:
        path = ("spec", "gpuClass")
    else:
        path = ("spec", "gpuRequest")
    return model.error(path, summary + detail)


def _too_big(pool: PoolNeed, inventory: GpuInventory) -> bool:
    """True when the weights alone outgrow every class's NUMA node at the utilisation cap."""
    def numa_bytes(gpu: GpuClass) -> float:
        node = inventory.node(gpu.name)
        return MAX_UTILIZATION * gpu.memory_bytes * min(node.gpus_per_numa_node, node.count)

    return all(pool.weights > numa_bytes(g) for g in inventory.usable())


def _contexts(model: LoadedModel, arch: Architecture) -> list[int] | ConfigError:
    spec = model.spec
    if spec.contexts is None:
        return [arch.max_position] if arch.max_position <= 2048 else [2048, arch.max_position]
    raw = model.located.data.get("spec", {}).get("contexts") if isinstance(model.located.data, dict) else None
    for context in spec.contexts:
        if context > arch.max_position:
            index = raw.index(context) if isinstance(raw, list) and context in raw else 0
            return model.error(("spec", "contexts", index), (
                f"context {context} is above the model's longest ({arch.max_position}, its "
                "max_position_embeddings): vLLM refuses a --max-model-len past it"))
    return list(spec.contexts)


def plan_model(model: LoadedModel, inventory: GpuInventory, *, declared: Collection[str] = ()) -> ModelPlan:
    """The pools of ``model``: one per context track, shortest first, then a canary pool when
    ``spec.canary.model`` is not among ``declared`` (the LLMModels planned with it that are
    canaries by ``canaryOf``). Raises :class:`ConfigError` with one ``FILE:LINE`` problem when
    it cannot be planned."""
    arch = resolve_architecture(model)
    contexts = _contexts(model, arch)
    if isinstance(contexts, ConfigError):
        raise contexts
    spec = model.spec
    block, _ = block_size(arch)
    pools: list[PoolPlan] = []
    for context in contexts:
        pool = PoolNeed(arch, spec.quantization, context, spec.kind == "embedding",
                     spec.gpu_request_bytes, spec.sla.p99_latency_s * 1000, block)
        fit = _choose(pool, model, inventory)
        if isinstance(fit, ConfigError):
            raise fit
        pools.append(pool_plan(model, pool, fit, f"{model.name}-{pool_label(context)}", model.name,
                                spec.model_path))
    canary = spec.canary
    if canary is not None and canary.model not in declared and canary.model != model.name:
        longest = pools[-1]
        name = canary.model
        args = tuple(name if i and longest.vllm_args[i - 1] == "--served-model-name" else a
                     for i, a in enumerate(longest.vllm_args))
        reasons = dict(longest.reasons)
        reasons["--served-model-name"] = (
            f"the canary {name!r} is declared by no LLMModel beside this one, so this pool serves it, "
            f"planned as the longest pool ({longest.name})")
        pools.append(replace(longest, name=f"{model.name}-canary", serves=name,
                             model_path=canary.model_path or spec.model_path, vllm_args=args,
                             reasons=MappingProxyType(reasons)))
    return ModelPlan(model, tuple(pools))


def plan_models(models: Sequence[LoadedModel], inventory: GpuInventory) -> list[ModelPlan]:
    """Every model's plan; raises one :class:`ConfigError` with every model's problem. A model
    another names as its canary gets no canary pool planned for it only when it opts in with
    ``canaryOf`` (:func:`llmmodel.spec.canary_problems` refuses the rest)."""
    names = {m.name for m in models}
    declared = {m.name for m in models if m.spec.canary_of is not None and m.spec.canary_of in names}
    plans: list[ModelPlan] = []
    problems: list[Problem] = canary_problems(models)
    for model in models:
        try:
            plans.append(plan_model(model, inventory, declared=declared))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return plans
