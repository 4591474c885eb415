"""What the planner decides, as plain frozen values: one :class:`ModelPlan` per LLMModel, one
:class:`PoolPlan` per context track. ``plan``, ``onboard``, ``up --models`` and the operator
all read these; only :mod:`llmmodel.planner` makes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from llmmodel.spec import LoadedModel


@dataclass(frozen=True)
class PoolPlan:
    """One vLLM pool of a model: a context track, its GPUs and its engine flags."""

    name: str
    """``<model>-<context label>``: ``contract-review-v2-2k``, ``...-32k``, ``...-canary``."""
    context: int
    """The pool's ``--max-model-len`` (its routing ``max_context``)."""
    gpu_class: str
    gpus_per_replica: int
    tensor_parallel_size: int
    gpu_memory_bytes: int
    """Memory of one GPU of ``gpu_class``."""
    gpu_memory_utilization: float
    """vLLM's ``--gpu-memory-utilization``: the share of each GPU it may use."""
    kv_cache_dtype: Literal["auto", "fp8"]
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    weights_bytes: int
    """All weights, across the replica's GPUs."""
    kv_bytes_per_token: int
    """Across all layers and the whole replica (2 x layers x kv_heads x head_dim x element)."""
    kv_cache_tokens: int
    """Tokens of KV cache the replica holds."""
    max_concurrent_sequences: int
    """Sequences of ``context`` tokens the KV cache holds at once."""
    host_memory_bytes: int
    """The Deployment's memory limit: the weights (page cache, mlock) and a margin."""
    vllm_args: tuple[str, ...]
    """``("--max-model-len", "2048", ...)``: every flag the planner sets, in a fixed order."""
    reasons: Mapping[str, str]
    """Flag (``--max-num-seqs``, ...) to why it has its value, citing what it rests on."""
    decode_ms_per_token: float
    """The simulator's decode step for one sequence on this GPU class (weights / bandwidth)."""
    prefill_ms_per_token: float
    """The simulator's prefill time per prompt token on this GPU class."""
    serves: str
    """The model name this pool serves (the canary's name for a canary pool)."""
    model_path: str
    """Where this pool's weights are."""


    def flags(self) -> list[tuple[str, str, str]]:
        """Each flag of :attr:`vllm_args` as (flag, its value or ``""``, why): ``--no-X`` is
        explained under ``--X`` when it has no reason of its own. ``plan`` prints these and
        ``plan.md`` tabulates them."""
        out: list[tuple[str, str, str]] = []
        args = self.vllm_args
        i = 0
        while i < len(args):
            flag = args[i]
            valued = i + 1 < len(args) and not args[i + 1].startswith("--")
            value = args[i + 1] if valued else ""
            i += 2 if valued else 1
            why = self.reasons.get(flag) or self.reasons.get(flag.replace("--no-", "--", 1), "")
            out.append((flag, value, why))
        return out


@dataclass(frozen=True)
class ModelPlan:
    """Every pool of one LLMModel, and the model it came from."""

    model: LoadedModel
    pools: tuple[PoolPlan, ...]
    """Context tracks, shortest first; a canary pool (when the canary is not another declared
    model) last."""

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def kind(self) -> Literal["chat", "embedding"]:
        return self.model.spec.kind

    @property
    def serving_pools(self) -> tuple[PoolPlan, ...]:
        """The pools that serve the model's own name (no canary pool)."""
        return tuple(p for p in self.pools if p.serves == self.name)

    def as_json(self) -> dict[str, Any]:
        """The ``plan --json`` shape of this model."""
        return {"name": self.name, "pools": [{
            "name": p.name, "context": p.context, "gpu_class": p.gpu_class,
            "gpus_per_replica": p.gpus_per_replica,
            "tensor_parallel_size": p.tensor_parallel_size,
            "vllm_args": list(p.vllm_args), "kv_cache_tokens": p.kv_cache_tokens,
            "max_concurrent_sequences": p.max_concurrent_sequences,
            "reasons": dict(p.reasons)} for p in self.pools]}
