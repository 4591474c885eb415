"""The planner: from an LLMModel, its architecture and the GPU inventory, every pool's GPUs and
vLLM flags, each flag with the reason it has its value. Pure: no I/O beyond reading a local
model's ``config.json`` or GGUF header (:mod:`llmmodel.arch`).

Memory model, per GPU of a replica of ``tp`` GPUs (what vLLM does at start-up: it profiles a
forward pass of ``--max-num-batched-tokens`` tokens, then gives the KV cache whatever is left of
``--gpu-memory-utilization`` x GPU memory)::

    granted = utilization x GPU memory            (utilization = gpuRequest / tp / GPU memory)
    kv      = granted - weights / tp - overhead
    tokens  = kv / (2 x layers x kv_heads/tp x head_dim x element bytes), in whole blocks

and ``overhead`` = :data:`FIXED_OVERHEAD` + batched tokens x hidden x
:data:`ACTIVATION_BYTES_PER_HIDDEN` (see :func:`overhead_bytes` for where the figures come from).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal

from llmmodel.arch import resolve_architecture
from llmmodel.catalog import GIB, GpuClass, GpuInventory, find_base
from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.spec import Architecture, LoadedModel
from routing.errors import ConfigError, Problem

BITS_PER_PARAMETER: dict[str, float] = {
    "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8,
    # AWQ/GPTQ: 4-bit weights + an fp16 scale and 4-bit zero per group of 128 (AutoAWQ's and
    # AutoGPTQ's default group size) = 4.16 bits; the embeddings and output head stay fp16
    # (about 2.5% of a 13B model's parameters, +0.3 bits): 4.5 on average.
    "awq": 4.5, "gptq": 4.5,
    # llama.cpp's quantize README (tools/quantize, "Llama 2 7B" table): Q4_K_M 4.84 and Q5_K_M
    # 5.68 bits per weight, rounded up; Q8_0 is a block of 32 int8 weights and one fp16 scale:
    # 34 bytes / 32 weights = 8.5 bits.
    "q4_k_m": 4.85, "q5_k_m": 5.69, "q8_0": 8.5,
}
GGUF_QUANTS = ("q4_k_m", "q5_k_m", "q8_0")
MIN_CC: dict[str, tuple[int, int]] = {"bf16": (8, 0), "fp8": (8, 0), "awq": (7, 5)}
"""vLLM refuses bfloat16 below CC 8.0 ("Bfloat16 is only supported on GPUs with compute
capability of at least 8.0"); its FP8 weights run from CC 8.0 (weight-only Marlin kernels on
Ampere, native on 8.9+); its AWQ kernels need CC 7.5."""

FIXED_OVERHEAD = GIB
"""Per GPU, besides weights, KV and activations: CUDA context and non-torch allocations plus
CUDA graphs. A vLLM 0.10.2 start-up log of a Mistral-7B-sized model on an 80 GB GPU reports
0.07 GiB of non-torch memory and 0.67 GiB of CUDA graphs (0.74 GiB); rounded up to 1 GiB."""
ACTIVATION_BYTES_PER_HIDDEN = 32
"""Peak activation bytes per batched token per unit of hidden size: the same log reports 1.97 GiB
of peak activation for a 16,384-token profiling batch at hidden 4096 (31.5 bytes); 32 kept."""
MAX_UTILIZATION = 0.95
"""vLLM's ``--gpu-memory-utilization`` ceiling we allow: the rest is the CUDA driver's and the
fragmentation headroom vLLM's maintainers chose 0.9 as default for (vllm-project/vllm#1018)."""
BLOCK_SIZE_CAP = 32
"""vLLM's CUDA paged-attention kernel accepts block sizes up to 32 (vllm-project/vllm#11259)."""
LONG_CONTEXT = 32 * 1024
"""Above this, a pool runs one sequence at a time without chunked prefill (a rule every plan
keeps): one such sequence's KV cache fills much of a GPU, and its prompt is prefilled in one step."""
MIN_SEQUENCES = 2
"""Full-context sequences a pool of at most 32K holds at once, so one long request never blocks
the next one's prefill (which would put it in the TTFT P99)."""
TYPICAL_PROMPT = 1024
"""The prompt the TTFT SLA is held to: an idle replica must prefill this many tokens (or the
whole context, when shorter) within ``sla.p99Latency``."""
MFU = 0.5
"""Share of the dense FP16 TFLOPs a prefill reaches (model FLOPs utilisation)."""
MAX_NUM_SEQS = 256
"""vLLM's default ``--max-num-seqs``; the planner never sets more."""
CHUNK_RANGE = (512, 8192)


def pool_label(context: int) -> str:
    """``2k`` for 2048, ``32k`` for 32768, the number itself when not a multiple of 1024."""
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def weights_bytes(arch: Architecture, quantization: str) -> int:
    return math.ceil(arch.parameter_count * BITS_PER_PARAMETER[quantization] / 8)


def kv_bytes_per_token(arch: Architecture, element_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x element bytes, over the whole replica."""
    return 2 * arch.layers * arch.kv_head_count * arch.head_size * element_bytes


def kv_bytes_per_token_per_gpu(arch: Architecture, element_bytes: int, tp: int) -> int:
    """One GPU's share: vLLM splits the KV heads over the ``tp`` GPUs, and replicates them when
    there are fewer heads than GPUs."""
    heads = math.ceil(arch.kv_head_count / tp)
    return 2 * arch.layers * heads * arch.head_size * element_bytes


def overhead_bytes(arch: Architecture, batched_tokens: int) -> int:
    return FIXED_OVERHEAD + batched_tokens * arch.hidden_size * ACTIVATION_BYTES_PER_HIDDEN


def kv_capacity_tokens(granted_per_gpu: int, weights_per_gpu: int, overhead: int,
                       kv_per_token_per_gpu: int, block_size: int) -> int:
    """Tokens of KV cache left on each GPU, in whole blocks (vLLM's "GPU KV cache size")."""
    free = granted_per_gpu - weights_per_gpu - overhead
    if free <= 0:
        return 0
    return free // (kv_per_token_per_gpu * block_size) * block_size


def block_size(arch: Architecture) -> tuple[int, str]:
    notes = min(64, 32 * math.ceil(arch.layers / 32))
    size = min(notes, BLOCK_SIZE_CAP)
    why = (f"the notes' rule min(64, 32 x ceil({arch.layers} layers / 32)) = {notes}"
           + (f", capped at {BLOCK_SIZE_CAP}: vLLM's CUDA paged-attention kernel accepts block sizes up to "
              "32 (vllm-project/vllm#11259)" if size < notes else "")
           + "; a multiple of 16 as FlashAttention requires")
    return size, why


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


@dataclass(frozen=True)
class _Fit:
    gpu: GpuClass
    tp: int
    utilization: float
    kv_dtype: Literal["auto", "fp8"]
    kv_tokens: int
    batched: int
    overhead: int
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    power_note: str


@dataclass(frozen=True)
class _Miss:
    kind: Literal["grant", "numa", "ttft", "cc", "heads"]
    text: str


@dataclass(frozen=True)
class _Pool:
    """What one pool asks for, independent of the GPU."""

    arch: Architecture
    quantization: str
    context: int
    embedding: bool
    granted: int
    p99_ms: float
    block: int

    @property
    def long(self) -> bool:
        return self.context > LONG_CONTEXT

    @property
    def chunked(self) -> bool:
        return not self.long and not self.embedding

    @property
    def required(self) -> int:
        return 1 if self.long else MIN_SEQUENCES

    @property
    def weights(self) -> int:
        return weights_bytes(self.arch, self.quantization)


def _speeds(pool: _Pool, gpu: GpuClass, tp: int, power_ratio: float) -> tuple[float, float]:
    """(prefill ms per token, decode ms per step) on ``tp`` GPUs of ``gpu``: prefill is
    compute-bound (2 x parameters FLOPs per token at :data:`MFU`), decode memory-bound (every
    weight read once per step)."""
    flops = gpu.tflops_fp16 * 1e12 * tp * MFU * power_ratio
    prefill = 2 * pool.arch.parameter_count / flops * 1000
    decode = pool.weights / tp / (gpu.bandwidth_gbps * 1e9) * 1000
    return prefill, decode


def _batched(pool: _Pool, prefill_ms: float) -> int:
    budget = pool.p99_ms / 2 / prefill_ms
    chunk = 1 << max(0, int(math.log2(max(budget, 1))))
    chunk = min(max(chunk, CHUNK_RANGE[0]), CHUNK_RANGE[1])
    if pool.embedding:
        return max(pool.context, CHUNK_RANGE[1])
    return pool.context if pool.long else min(chunk, max(pool.context, CHUNK_RANGE[0]))


def _try_gpu(pool: _Pool, gpu: GpuClass, inventory: GpuInventory) -> _Fit | _Miss:
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
    miss = _Miss("numa", f"{_gib(pool.granted)} needs more than {numa} GPU(s) of {gpu.memory_gib:.1f} GiB "
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
            if isinstance(found, _Fit) or found.kind == "grant":
                return found
            miss = found
        tp *= 2
    return miss


def _fit_at(pool: _Pool, gpu: GpuClass, tp: int, power_ratio: float, power_note: str) -> _Fit | _Miss:
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
            return _Fit(gpu, tp, utilization, dtype, tokens, batched, overhead, prefill, decode, ttft,
                        power_note)
    need = pool.required * pool.context * kv_bytes_per_token_per_gpu(pool.arch, element, tp)
    return _Miss("grant", (f"{tp} GPU(s) at {_gib(granted)} each hold weights {_gib(weights)} + overhead "
                           f"{_gib(overhead)}, leaving room for {tokens} KV tokens, not the "
                           f"{pool.required} x {pool.context} the pool needs ({_gib(need)} more per GPU "
                           f"at most)"))


def _choose(pool: _Pool, model: LoadedModel, inventory: GpuInventory) -> _Fit | ConfigError:
    spec = model.spec
    if spec.gpu_class is not None:
        if spec.gpu_class not in inventory.classes or spec.gpu_class not in inventory.nodes:
            there = ", ".join(g.name for g in inventory.usable())
            return model.error(("spec", "gpuClass"), f"GPU class {spec.gpu_class!r} is not in the inventory "
                                                     f"({inventory.source}: {there})")
        candidates = [inventory.classes[spec.gpu_class]]
    else:
        candidates = inventory.usable()
    fits: list[_Fit] = []
    misses: list[tuple[str, _Miss]] = []
    for gpu in candidates:
        found = _try_gpu(pool, gpu, inventory)
        if isinstance(found, _Fit):
            fits.append(found)
        else:
            misses.append((gpu.name, found))
    if fits:
        return min(fits, key=lambda f: (f.gpu.cost_per_hour is None, (f.gpu.cost_per_hour or 0) * f.tp,
                                        f.tp, f.gpu.name))
    return _refusal(pool, model, inventory, misses)


def _refusal(pool: _Pool, model: LoadedModel, inventory: GpuInventory,
             misses: list[tuple[str, _Miss]]) -> ConfigError:
    kinds = {miss.kind for _, miss in misses}
    spec = model.spec
    kv_need = pool.required * pool.context * kv_bytes_per_token(pool.arch, 2)
    summary = (f"pool {model.name}-{pool_label(pool.context)} fits no GPU of the {inventory.source} within "
               f"one NUMA node: it needs {_gib(pool.weights)} of {pool.quantization} weights "
               f"({pool.arch.parameter_count / 1e9:.1f}B parameters) + {_gib(FIXED_OVERHEAD)}+ overhead per "
               f"GPU + KV for {pool.required} sequence(s) of {pool.context} tokens ({_gib(kv_need)} in fp16) "
               f"out of gpuRequest {_gib(pool.granted)}; ")
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


def _too_big(pool: _Pool, inventory: GpuInventory) -> bool:
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
    ``spec.canary.model`` is not among ``declared`` (the names of the LLMModels planned with
    it). Raises :class:`ConfigError` with one ``FILE:LINE`` problem when it cannot be planned."""
    arch = resolve_architecture(model)
    contexts = _contexts(model, arch)
    if isinstance(contexts, ConfigError):
        raise contexts
    spec = model.spec
    block, _ = block_size(arch)
    pools: list[PoolPlan] = []
    for context in contexts:
        pool = _Pool(arch, spec.quantization, context, spec.kind == "embedding",
                     spec.gpu_request_bytes, spec.sla.p99_latency_s * 1000, block)
        fit = _choose(pool, model, inventory)
        if isinstance(fit, ConfigError):
            raise fit
        pools.append(_pool_plan(model, pool, fit, f"{model.name}-{pool_label(context)}", model.name,
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
    """Every model's plan; raises one :class:`ConfigError` with every model's problem."""
    declared = {m.name for m in models}
    plans: list[ModelPlan] = []
    problems: list[Problem] = []
    for model in models:
        try:
            plans.append(plan_model(model, inventory, declared=declared))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return plans


def _pool_plan(model: LoadedModel, pool: _Pool, fit: _Fit, name: str, serves: str,
               model_path: str) -> PoolPlan:
    arch, gpu, tp, context = pool.arch, fit.gpu, fit.tp, pool.context
    element = 1 if fit.kv_dtype == "fp8" else 2
    per_token = kv_bytes_per_token(arch, element)
    per_token_gpu = kv_bytes_per_token_per_gpu(arch, element, tp)
    granted = int(fit.utilization * gpu.memory_bytes)
    weights_gpu = math.ceil(pool.weights / tp)
    concurrent = fit.kv_tokens // context
    if pool.long:
        seqs, seqs_why = 1, f"a {context}-token pool (above {LONG_CONTEXT}) runs one sequence at a time"
    else:
        expected = max(1, context // 2)
        seqs = min(MAX_NUM_SEQS, max(1, fit.kv_tokens // expected))
        seqs_why = (f"KV capacity {fit.kv_tokens} tokens / expected sequence {expected} tokens (half the "
                    f"context: prompt + answer rarely fill it) = {fit.kv_tokens // expected}, kept within "
                    f"1..{MAX_NUM_SEQS} (vLLM's default); {concurrent} full {context}-token sequences fit "
                    "at once, vLLM preempts past that")
    batched_why = (f"{fit.batched}: the whole context in one step, as vLLM requires without chunked prefill"
                   if not pool.chunked else
                   f"{fit.batched}: a power of two whose prefill ({fit.batched} x {fit.prefill_ms:.3f} ms = "
                   f"{fit.batched * fit.prefill_ms:.0f} ms) stays within half the {pool.p99_ms:.0f} ms P99 "
                   f"TTFT, in {CHUNK_RANGE[0]}..{CHUNK_RANGE[1]} and at most the context")
    if pool.embedding and pool.context < fit.batched:
        batched_why = (f"{fit.batched}: several whole inputs per step (an embedding model is not chunked, "
                       f"so at least the {context}-token context)")
    _, block_why = block_size(arch)
    cost = f"${gpu.cost_per_hour * tp:.2f}/h" if gpu.cost_per_hour is not None else "unpriced"
    chosen = (f"gpuClass {gpu.name}" if model.spec.gpu_class else
              f"{gpu.name} is the cheapest class that fits ({tp} x {gpu.name} = {cost} per replica)")
    reasons: dict[str, str] = {
        "--max-model-len": f"the pool's context track: {context} tokens (model maximum {arch.max_position})",
        "--tensor-parallel-size": (
            f"{chosen}; {tp} GPU(s): the smallest power of two dividing {arch.attention_heads} attention and "
            f"{arch.kv_head_count} KV heads whose share of gpuRequest ({_gib(pool.granted)} / {tp} = "
            f"{_gib(pool.granted / tp)}) is at most {MAX_UTILIZATION:.0%} of one GPU and holds "
            f"{pool.required} x {context}-token sequence(s); within one NUMA node{fit.power_note}"),
        "--gpu-memory-utilization": (
            f"gpuRequest / ({tp} x {gpu.memory_gib:.1f} GiB) = {fit.utilization:.2f} (rounded down, cap "
            f"{MAX_UTILIZATION}): per GPU {_gib(granted)} = weights {_gib(weights_gpu)} + overhead "
            f"{_gib(fit.overhead)} (CUDA context and graphs {_gib(FIXED_OVERHEAD)} + activations "
            f"{fit.batched} tokens x {arch.hidden_size} x {ACTIVATION_BYTES_PER_HIDDEN} B) + KV "
            f"{_gib(fit.kv_tokens * per_token_gpu)} ({fit.kv_tokens} tokens x {per_token_gpu} B)"),
        "--kv-cache-dtype": (
            f"auto (the weights' 16-bit type): 2 x {arch.layers} layers x {arch.kv_head_count} KV heads x "
            f"{arch.head_size} head dim x 2 B = {per_token} B per token already holds {concurrent} "
            f"sequence(s) of {context}" if fit.kv_dtype == "auto" else
            f"fp8: 16-bit KV would not hold {pool.required} sequence(s) of {context} tokens; {gpu.name} has "
            f"compute capability {gpu.cc_text} (FP8 KV only from 8.0); 2 x {arch.layers} x "
            f"{arch.kv_head_count} x {arch.head_size} x 1 B = {per_token} B per token"),
        "--block-size": f"{pool.block}: {block_why}",
        "--max-num-seqs": f"{seqs}: {seqs_why}",
        "--max-num-batched-tokens": batched_why,
        "--enable-prefix-caching": (
            "chat requests share system prompts and conversation history: reused KV blocks skip prefill"
            if not pool.embedding else
            "off: an embedding request is one pass with nothing reused"),
    }
    args: list[str] = [
        "--max-model-len", str(context), "--tensor-parallel-size", str(tp),
        "--gpu-memory-utilization", f"{fit.utilization:.2f}", "--kv-cache-dtype", fit.kv_dtype,
        "--block-size", str(pool.block), "--max-num-seqs", str(seqs),
        "--max-num-batched-tokens", str(fit.batched),
        "--enable-prefix-caching" if not pool.embedding else "--no-enable-prefix-caching",
    ]
    quant = pool.quantization
    if quant in ("awq", "gptq", "fp8"):
        args += ["--quantization", quant]
        reasons["--quantization"] = (f"{quant} weights: {BITS_PER_PARAMETER[quant]} bits per parameter "
                                     f"= {_gib(pool.weights)}")
    elif quant in GGUF_QUANTS:
        base = find_base(model.spec.base) if model.spec.base else None
        reasons["--quantization"] = (f"none: vLLM reads a .gguf file's {quant} tensors itself "
                                     f"({BITS_PER_PARAMETER[quant]} bits per weight = {_gib(pool.weights)})")
        if base is not None:
            args += ["--tokenizer", base.hf_repo]
            reasons["--tokenizer"] = (f"{base.hf_repo}: the base model's Hugging Face tokenizer, which vLLM "
                                      "recommends beside a .gguf file over converting the one inside it")
    if pool.embedding:
        args += ["--runner", "pooling"]
        reasons["--runner"] = ("pooling: an embedding model (vLLM's --runner replaced --task embed, "
                               "vllm-project/vllm#21470)")
    args.append("--enable-chunked-prefill" if pool.chunked else "--no-enable-chunked-prefill")
    reasons["--enable-chunked-prefill"] = (
        f"on: prompts are prefilled in {fit.batched}-token chunks between decode steps, so a long prompt "
        "does not stall the running sequences" if pool.chunked else
        f"off: {'an embedding model is encoded in one pass' if pool.embedding else f'a {context}-token pool'}"
        f"{'' if pool.embedding else f' is above {LONG_CONTEXT}: one sequence, its prompt in one step'}")
    args += ["--served-model-name", serves]
    reasons["--served-model-name"] = f"the model name clients send: {serves}"
    # The pod's memory limit: the weights stay in the page cache (warmed and mlocked before vLLM
    # loads them), plus about 2 GiB of resident memory for the API process and each GPU worker.
    host = math.ceil((pool.weights + 2 * GIB * (tp + 1)) / GIB) * GIB
    return PoolPlan(
        name=name, context=context, gpu_class=gpu.name, gpus_per_replica=tp, tensor_parallel_size=tp,
        gpu_memory_bytes=gpu.memory_bytes, gpu_memory_utilization=fit.utilization,
        kv_cache_dtype=fit.kv_dtype, block_size=pool.block, max_num_seqs=seqs,
        max_num_batched_tokens=fit.batched, enable_prefix_caching=not pool.embedding,
        enable_chunked_prefill=pool.chunked, weights_bytes=pool.weights, kv_bytes_per_token=per_token,
        kv_cache_tokens=fit.kv_tokens, max_concurrent_sequences=concurrent, host_memory_bytes=host,
        vllm_args=tuple(args), reasons=MappingProxyType(reasons),
        decode_ms_per_token=round(fit.decode_ms, 3), prefill_ms_per_token=round(fit.prefill_ms, 4),
        serves=serves, model_path=model_path)
