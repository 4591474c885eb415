"""One pool's vLLM flags, each with the reason it has its value, from the sizing the planner chose
(:class:`llmmodel.sizing.Fit`). The figures come from the planner's formulas; this module only
decides the flags that follow from them and says why, for ``llm-sidecar plan`` to print."""

from __future__ import annotations

import math
from types import MappingProxyType

from llmmodel.catalog import GIB, find_base
from llmmodel.plans import PoolPlan
from llmmodel.sizing import (
    ACTIVATION_BYTES_PER_HIDDEN,
    BITS_PER_PARAMETER,
    CHUNK_RANGE,
    FIXED_OVERHEAD,
    LONG_CONTEXT,
    MAX_UTILIZATION,
    Fit,
    PoolNeed,
    block_size,
    gib,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
)
from llmmodel.spec import LoadedModel

GGUF_QUANTS = ("q4_k_m", "q5_k_m", "q8_0")
MAX_NUM_SEQS = 256
"""vLLM's default ``--max-num-seqs``; the planner never sets more."""


def pool_plan(model: LoadedModel, pool: PoolNeed, fit: Fit, name: str, serves: str,
              model_path: str) -> PoolPlan:
    """The plan of pool ``name`` of ``model``, serving ``serves`` from ``model_path``."""
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
            f"{arch.kv_head_count} KV heads whose share of gpuRequest ({gib(pool.granted)} / {tp} = "
            f"{gib(pool.granted / tp)}) is at most {MAX_UTILIZATION:.0%} of one GPU and holds "
            f"{pool.required} x {context}-token sequence(s); within one NUMA node{fit.power_note}"),
        "--gpu-memory-utilization": (
            f"gpuRequest / ({tp} x {gpu.memory_gib:.1f} GiB) = {fit.utilization:.2f} (rounded down, cap "
            f"{MAX_UTILIZATION}): per GPU {gib(granted)} = weights {gib(weights_gpu)} + overhead "
            f"{gib(fit.overhead)} (CUDA context and graphs {gib(FIXED_OVERHEAD)} + activations "
            f"{fit.batched} tokens x {arch.hidden_size} x {ACTIVATION_BYTES_PER_HIDDEN} B) + KV "
            f"{gib(fit.kv_tokens * per_token_gpu)} ({fit.kv_tokens} tokens x {per_token_gpu} B)"),
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
                                     f"= {gib(pool.weights)}")
    elif quant in GGUF_QUANTS:
        base = find_base(model.spec.base) if model.spec.base else None
        reasons["--quantization"] = (f"none: vLLM reads a .gguf file's {quant} tensors itself "
                                     f"({BITS_PER_PARAMETER[quant]} bits per weight = {gib(pool.weights)})")
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
