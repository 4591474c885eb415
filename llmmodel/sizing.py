"""The memory model and formulas the planner sizes pools with (no choice is made here).

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
from dataclasses import dataclass
from typing import Literal

from llmmodel.catalog import GIB, GpuClass
from llmmodel.spec import Architecture

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
CHUNK_RANGE = (512, 8192)


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


def gib(value: float) -> str:
    """Bytes as the reasons and errors print them."""
    return f"{value / GIB:.2f} GiB"


@dataclass(frozen=True)
class Fit:
    """The GPU class and sizing chosen for one pool: what :func:`llmmodel.flags.pool_plan` renders."""

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
class PoolNeed:
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
