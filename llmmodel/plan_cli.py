"""``llm-sidecar plan FILE... [--gpus FILE] [--json]``: print each model's pools, their GPUs and
vLLM flags with the reason for each, or the plan as JSON. Exit 1 with ``FILE:LINE: message``
lines when a model is invalid or fits no GPU."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from routing.errors import ConfigError

if TYPE_CHECKING:
    from llmmodel.plans import ModelPlan, PoolPlan

# The planner and its catalogs load only when `plan` runs or prints its help: every other
# command (extproc, ratelimit, sim: processes the gateway starts often) builds this parser too.
_CATALOG_EPILOG = "(the built-in bases and GPUs)"


class _PlanHelp(argparse.HelpFormatter):
    """Writes the catalog's names in place of :data:`_CATALOG_EPILOG` when help is printed."""

    def add_text(self, text: str | None) -> None:
        if text is _CATALOG_EPILOG:
            from llmmodel.catalog import BASE_MODELS, BUILTIN_GPUS
            text = (f"built-in bases: {', '.join(BASE_MODELS)}. "
                    f"Built-in GPUs: {', '.join(BUILTIN_GPUS)}.")
        super().add_text(text)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="LLMModel YAML files, or directories of them")
    parser.add_argument("--gpus", metavar="FILE", default=None,
                        help="GPU classes to add or override, and the nodes there are (YAML: gpus:, nodes:)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.epilog = _CATALOG_EPILOG
    parser.formatter_class = _PlanHelp


def plan_command(args: argparse.Namespace) -> int:
    from llmmodel.catalog import load_gpus
    from llmmodel.planner import plan_models
    from llmmodel.spec import load_models, model_files
    try:
        inventory = load_gpus(args.gpus)
        if not model_files(args.files):
            raise ConfigError.at(args.files[0], 1, "no LLMModel files (*.yaml, *.yml) here")
        plans = plan_models(load_models(args.files), inventory)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"models": [plan.as_json() for plan in plans]}, indent=2))
    else:
        print("\n".join(render(plans)))
    return 0


def render(plans: list[ModelPlan]) -> Iterator[str]:
    """The text report: per model, per pool, each flag with its reason."""
    for plan in plans:
        yield f"model {plan.name} ({plan.kind}, {plan.model.located.source})"
        for pool in plan.pools:
            yield from _pool_lines(pool, plan.name)
        yield ""


def _pool_lines(pool: PoolPlan, model: str) -> Iterator[str]:
    serves = "" if pool.serves == model else f", serves {pool.serves}"
    yield (f"  pool {pool.name}: {pool.context} tokens on {pool.gpus_per_replica} x {pool.gpu_class} "
           f"(tensor parallel {pool.tensor_parallel_size}){serves}")
    seqs = pool.max_concurrent_sequences
    plural = "" if seqs == 1 else "s"
    yield (f"    KV cache: {pool.kv_cache_tokens} tokens = {seqs} concurrent sequence{plural} "
           f"of {pool.context} tokens ({pool.kv_bytes_per_token} bytes per token)")
    for flag, value, why in pool.flags():
        yield f"    {flag}{' ' + value if value else ''}"
        if why:
            yield f"        {why}"
