"""Hand-built :class:`ModelPlan` values for tests of what reads plans (routing merge, Kubernetes
objects, ``onboard``), so those tests do not depend on the planner's arithmetic.

The LLMModel is real: YAML text validated by :func:`llmmodel.spec.validate_model`, so its
``problem()`` lines point into that text. The pools carry plausible figures for an A100-80GB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import yaml

from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.spec import validate_model
from routing.yamlsrc import load_yaml

GIB = 1 << 30


def model_yaml(name: str, *, contexts: Sequence[int] | None, kind: str, canary: dict[str, Any] | None,
               limits: dict[str, Any] | None, model_path: str, gpu_class: str | None,
               replicas: dict[str, int] | None, sla: dict[str, str] | None,
               canary_of: str | None = None) -> str:
    """The LLMModel document's text, one key a line (so problems have distinct lines)."""
    spec: dict[str, Any] = {"modelPath": model_path, "quantization": "fp16", "gpuRequest": "40Gi",
                            "sla": sla or {"p99Latency": "200ms", "availability": "99.95%"},
                            "kind": kind}
    if contexts is not None:
        spec["contexts"] = list(contexts)
    for key, value in (("gpuClass", gpu_class), ("replicas", replicas), ("limits", limits),
                       ("canary", canary), ("canaryOf", canary_of)):
        if value is not None:
            spec[key] = value
    doc = {"apiVersion": "llm-sidecar.dev/v1alpha1", "kind": "LLMModel",
           "metadata": {"name": name}, "spec": spec}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def context_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def pool_plan(model: str, context: int, *, serves: str | None = None, name: str | None = None,
              gpus: int = 1, model_path: str = "pvc://models/contract-v2",
              kind: str = "chat") -> PoolPlan:
    """One pool with every field filled; ``vllm_args`` in the planner's order."""
    args = ["--max-model-len", str(context), "--tensor-parallel-size", str(gpus),
            "--gpu-memory-utilization", "0.9", "--kv-cache-dtype", "fp8", "--block-size", "16",
            "--max-num-seqs", "64" if context <= 32768 else "1",
            "--max-num-batched-tokens", str(max(8192, context))]
    if kind == "chat":
        args.append("--enable-prefix-caching")
    reasons = {flag: f"why {flag} (test)" for flag in args if flag.startswith("--")}
    kv_per_token = 409_600
    kv_tokens = 90_000 * gpus
    return PoolPlan(
        name=name or f"{model}-{context_label(context)}", context=context, gpu_class="A100-80GB",
        gpus_per_replica=gpus, tensor_parallel_size=gpus, gpu_memory_bytes=80 * GIB,
        gpu_memory_utilization=0.9, kv_cache_dtype="fp8", block_size=16,
        max_num_seqs=64 if context <= 32768 else 1, max_num_batched_tokens=max(8192, context),
        enable_prefix_caching=kind == "chat", enable_chunked_prefill=context <= 32768,
        weights_bytes=26 * GIB, kv_bytes_per_token=kv_per_token, kv_cache_tokens=kv_tokens,
        max_concurrent_sequences=kv_tokens // context, host_memory_bytes=40 * GIB,
        vllm_args=tuple(args), reasons=reasons, decode_ms_per_token=8.125,
        prefill_ms_per_token=0.05, serves=serves or model, model_path=model_path)


def model_plan(name: str = "contract-review-v2", contexts: Sequence[int] = (2048, 4096),
               kind: Literal["chat", "embedding"] = "chat", canary: dict[str, Any] | None = None,
               limits: dict[str, Any] | None = None, *, canary_pool: bool = True,
               model_path: str = "pvc://models/contract-v2", gpu_class: str | None = None,
               replicas: dict[str, int] | None = None, sla: dict[str, str] | None = None,
               gpus: int = 1, source: str = "models/x.yaml", canary_of: str | None = None) -> ModelPlan:
    """A plan of ``name`` with one pool per context, shortest first; with ``canary`` and
    ``canary_pool``, a last pool ``<name>-canary`` serving the canary's model at the longest
    context (what the planner does when no declared LLMModel serves the canary). ``canary_of``:
    the stable model this one is the declared canary of."""
    text = model_yaml(name, contexts=contexts, kind=kind, canary=canary, limits=limits,
                      model_path=model_path, gpu_class=gpu_class, replicas=replicas, sla=sla,
                      canary_of=canary_of)
    loaded = validate_model(load_yaml(text, source))
    pools = [pool_plan(name, c, gpus=gpus, model_path=model_path, kind=kind)
             for c in sorted(contexts)]
    if canary is not None and canary_pool:
        pools.append(pool_plan(name, max(contexts), serves=str(canary["model"]),
                               name=f"{name}-canary", gpus=gpus,
                               model_path=str(canary.get("modelPath", model_path)), kind=kind))
    return ModelPlan(model=loaded, pools=tuple(pools))
