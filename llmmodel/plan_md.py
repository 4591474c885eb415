"""``plan.md``: the plan a reviewer reads before applying what ``onboard`` wrote: per pool the
GPUs, every vLLM flag with the reason for its value, and the KV-cache capacity."""

from __future__ import annotations

from collections.abc import Sequence

from llmmodel.plans import ModelPlan, PoolPlan

GIB = 1 << 30


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _pool(pool: PoolPlan, model: str) -> list[str]:
    role = "" if pool.serves == model else f" (serves `{pool.serves}`)"
    lines = [
        f"### `{pool.name}`{role}", "",
        f"- context: {pool.context} tokens",
        f"- GPU: {pool.gpus_per_replica} x {pool.gpu_class} per replica "
        f"({pool.gpu_memory_bytes / GIB:.0f} GiB each), tensor parallel {pool.tensor_parallel_size}",
        f"- weights: {pool.weights_bytes / GIB:.1f} GiB from `{pool.model_path}`; "
        f"pod memory limit {pool.host_memory_bytes / GIB:.1f} GiB",
        f"- KV cache: {pool.kv_cache_tokens:,} tokens ({pool.kv_bytes_per_token:,} bytes per "
        f"token, {pool.kv_cache_dtype}), {pool.max_concurrent_sequences} sequences of "
        f"{pool.context} tokens at once",
        f"- simulated speed: decode {pool.decode_ms_per_token:g} ms/token, prefill "
        f"{pool.prefill_ms_per_token:g} ms/token", "",
        "| flag | value | why |", "|---|---|---|"]
    for flag, value, why in pool.flags():
        lines.append(f"| `{flag}` | {f'`{value}`' if value else '(set)'} | {_cell(why)} |")
    return [*lines, ""]


def plan_markdown(plans: Sequence[ModelPlan]) -> str:
    """The whole plan, one section per model, in the order given."""
    lines = ["# LLMModel plan", "",
             "Written by `llm-sidecar onboard`; the same models and GPU catalog give the same plan.",
             ""]
    for plan in plans:
        spec = plan.model.spec
        lines += [f"## `{plan.name}` ({plan.kind})", "",
                  f"From {plan.model.located.source}. SLA: time to first token P99 "
                  f"{spec.sla.p99_latency}, availability {spec.sla.availability}; replicas "
                  f"{spec.replicas.min} to {spec.replicas.max}.", ""]
        if spec.canary is not None:
            lines += [f"Canary: `{spec.canary.model}`, {spec.canary.percent:g}% by "
                      f"{spec.canary.sticky}.", ""]
        for pool in plan.pools:
            lines += _pool(pool, plan.name)
    return "\n".join(lines).rstrip("\n") + "\n"
