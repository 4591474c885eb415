"""What the planner knows without asking: GPUs (memory, compute capability, bandwidth, power,
speed, price), the nodes they sit in, and the architecture of common open models.

The GPU catalog can be extended or overridden by ``--gpus FILE``, which also
describes the nodes; :func:`load_gpus` reads it strictly, with ``FILE:LINE`` errors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmmodel.spec import Architecture
from llmmodel.values import parse_bytes
from routing.errors import ConfigError, Problem
from routing.yamlsrc import Located, read_yaml

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class GpuClass:
    """One kind of GPU. ``memory_bytes`` is what ``nvidia-smi`` reports as total memory (vLLM's
    ``--gpu-memory-utilization`` is a share of it)."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    bandwidth_gbps: float
    """Memory bandwidth in GB/s (10^9 bytes per second): decode speed is bound by it."""
    power_w: int
    """Board power (TDP) in watts."""
    tflops_fp16: float
    """Dense FP16/BF16 tensor-core TFLOPs (no sparsity): prefill speed is bound by it."""
    cost_per_hour: float | None
    """Relative price of one GPU for an hour, for "the cheapest that fits"; None: unknown
    (ranked after every priced GPU)."""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def cc_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


# Spec-sheet figures (NVIDIA data sheets: memory as nvidia-smi reports it in MiB, CC from the CUDA
# GPU list, bandwidth, TDP of the SXM/PCIe board named, dense FP16 tensor TFLOPs). Prices are AWS
# us-east-1 on-demand list prices per GPU at each instance's launch (instance price / GPUs: p4d,
# p4de, p5, g6e, g5, g6, g4dn, p3dn; H200 estimated a little above H100), rounded: an
# order-of-magnitude ranking for "cheapest that fits", not a quote.
# Override any of them with --gpus FILE.
_BUILTIN_GPUS: tuple[GpuClass, ...] = (
    GpuClass("A100-40GB", 40960 * MIB, (8, 0), 1555, 400, 312, 4.10),
    GpuClass("A100-80GB", 81920 * MIB, (8, 0), 2039, 400, 312, 5.12),
    GpuClass("H100-80GB", 81559 * MIB, (9, 0), 3350, 700, 989, 12.29),
    GpuClass("H200", 143771 * MIB, (9, 0), 4800, 700, 989, 13.80),
    GpuClass("L40S", 46068 * MIB, (8, 9), 864, 350, 362, 1.86),
    # A10G: AWS's variant of the A10 (same memory and bandwidth; FP16 tensor figure of the A10).
    GpuClass("A10G", 23028 * MIB, (8, 6), 600, 300, 125, 1.01),
    GpuClass("L4", 23034 * MIB, (8, 9), 300, 72, 121, 0.80),
    GpuClass("T4-16GB", 15360 * MIB, (7, 5), 320, 70, 65, 0.53),
    GpuClass("V100-32GB", 32768 * MIB, (7, 0), 900, 300, 125, 3.90),
)
BUILTIN_GPUS: Mapping[str, GpuClass] = MappingProxyType({g.name: g for g in _BUILTIN_GPUS})

TFLOPS_PER_GBPS = 989 / 3350
"""A GPU added by ``--gpus`` without ``tflops_fp16`` is assumed as compute-rich per byte of
bandwidth as an H100 (its prefill estimate only)."""

DEFAULT_NODE_GPUS = 8
DEFAULT_GPUS_PER_NUMA = 4


@dataclass(frozen=True)
class NodeShape:
    """The nodes a GPU class sits in: tensor parallelism stays inside one NUMA node."""

    gpu: str
    count: int = DEFAULT_NODE_GPUS
    gpus_per_numa_node: int = DEFAULT_GPUS_PER_NUMA
    power_budget_w: int | None = None


@dataclass(frozen=True)
class GpuInventory:
    """The GPU classes the planner may use (``classes``) and their nodes (``nodes``, by GPU).
    Only classes with a node are planned on."""

    classes: Mapping[str, GpuClass]
    nodes: Mapping[str, NodeShape]
    source: str = "built-in catalog"

    def usable(self) -> list[GpuClass]:
        """Classes that have nodes, cheapest first (then by name, for stable plans)."""
        found = [self.classes[name] for name in self.nodes if name in self.classes]
        return sorted(found, key=_cost_key)

    def node(self, gpu: str) -> NodeShape:
        return self.nodes.get(gpu) or NodeShape(gpu)


def _cost_key(gpu: GpuClass) -> tuple[int, float, str]:
    return (gpu.cost_per_hour is None, gpu.cost_per_hour or 0.0, gpu.name)


def default_inventory() -> GpuInventory:
    """Every built-in GPU on nodes of 8, 4 per NUMA node: the layout a plan assumes without --gpus."""
    return GpuInventory(BUILTIN_GPUS, MappingProxyType({name: NodeShape(name) for name in BUILTIN_GPUS}))


# --- the --gpus FILE ------------------------------------------------------------------------------

_CC = re.compile(r"^(\d{1,2})\.(\d)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _GpuEntry(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    memory: str | int | None = None
    compute_capability: str | float | None = None
    bandwidth_gbps: float | None = Field(default=None, gt=0, le=1_000_000)
    power_w: int | None = Field(default=None, ge=1, le=100_000)
    tflops_fp16: float | None = Field(default=None, gt=0, le=1_000_000)
    cost_per_hour: float | None = Field(default=None, ge=0)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | int | None) -> str | int | None:
        if value is not None and parse_bytes(value) < GIB:
            raise ValueError(f"{value!r}: a GPU has at least 1Gi of memory")
        return value

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, value: str | float | None) -> str | float | None:
        if value is not None and not _CC.match(str(value)):
            raise ValueError(f"{value!r}: write a compute capability as MAJOR.MINOR, like \"8.0\"")
        return value


class _NodeEntry(_Strict):
    gpu: str
    count: int = Field(default=DEFAULT_NODE_GPUS, ge=1, le=1024)
    gpus_per_numa_node: int = Field(default=DEFAULT_GPUS_PER_NUMA, ge=1, le=1024)
    power_budget_w: int | None = Field(default=None, ge=1)


class _GpusFile(_Strict):
    gpus: list[_GpuEntry] = Field(default_factory=list)
    nodes: list[_NodeEntry] | None = None


def load_gpus(path: str | None) -> GpuInventory:
    """The inventory of ``--gpus FILE`` (None: :func:`default_inventory`). ``gpus:`` entries
    add a class or override fields of a built-in one; ``nodes:`` lists the nodes there are
    (without it, every class on nodes of 8, 4 per NUMA node). Raises :class:`ConfigError`."""
    if path is None:
        return default_inventory()
    located = read_yaml(path)
    data = located.data if located.data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError([located.problem((), "a --gpus file is a mapping with gpus: and nodes:")])
    try:
        parsed = _GpusFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_problems(exc, located)) from None
    problems: list[Problem] = []
    classes = dict(BUILTIN_GPUS)
    for i, entry in enumerate(parsed.gpus):
        if entry.name in [e.name for e in parsed.gpus[:i]]:
            problems.append(located.problem(("gpus", i, "name"), f"GPU {entry.name!r} is listed twice"))
            continue
        made = _gpu_class(entry, classes.get(entry.name))
        if isinstance(made, str):
            problems.append(located.problem(("gpus", i), made))
        else:
            classes[entry.name] = made
    nodes: dict[str, NodeShape] = {}
    for i, node in enumerate(parsed.nodes if parsed.nodes is not None else []):
        where = ("nodes", i)
        if node.gpu not in classes:
            problems.append(located.problem((*where, "gpu"), (
                f"unknown GPU {node.gpu!r} (known: {', '.join(sorted(classes))}; add it under gpus:)")))
        elif node.gpu in nodes:
            problems.append(located.problem((*where, "gpu"), f"nodes of {node.gpu!r} are listed twice"))
        elif node.gpus_per_numa_node > node.count:
            problems.append(located.problem((*where, "gpus_per_numa_node"), (
                f"{node.gpus_per_numa_node} GPUs per NUMA node on a node of {node.count}")))
        else:
            nodes[node.gpu] = NodeShape(node.gpu, node.count, node.gpus_per_numa_node, node.power_budget_w)
    if problems:
        raise ConfigError(problems)
    if parsed.nodes is None:
        nodes = {name: NodeShape(name) for name in classes}
    return GpuInventory(MappingProxyType(classes), MappingProxyType(nodes), path)


def _gpu_class(entry: _GpuEntry, base: GpuClass | None) -> GpuClass | str:
    """The class an entry describes, or why it cannot be one."""
    given: dict[str, Any] = {}
    if entry.memory is not None:
        given["memory_bytes"] = parse_bytes(entry.memory)
    if entry.compute_capability is not None:
        match = _CC.match(str(entry.compute_capability))
        assert match is not None  # checked by the validator
        given["compute_capability"] = (int(match.group(1)), int(match.group(2)))
    for key in ("bandwidth_gbps", "power_w", "tflops_fp16", "cost_per_hour"):
        if getattr(entry, key) is not None:
            given[key] = getattr(entry, key)
    if base is not None:
        return replace(base, **given)
    missing = [k for k, f in (("memory", "memory_bytes"), ("compute_capability", "compute_capability"),
                              ("bandwidth_gbps", "bandwidth_gbps")) if f not in given]
    if missing:
        return f"new GPU {entry.name!r} needs {', '.join(missing)} (it is not in the built-in catalog)"
    bandwidth = float(given["bandwidth_gbps"])
    return GpuClass(entry.name, given["memory_bytes"], given["compute_capability"], bandwidth,
                    int(given.get("power_w", 0)),
                    float(given.get("tflops_fp16", round(bandwidth * TFLOPS_PER_GBPS, 1))),
                    given.get("cost_per_hour"))


def _problems(exc: ValidationError, located: Located) -> list[Problem]:
    out: list[Problem] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            where = ".".join(str(p) for p in loc[:-1]) or "top level"
            message = f"unknown key {loc[-1]!r} in {where}"
        elif err["type"] == "missing":
            message = f"missing required key {dotted}"
        else:
            message = f"{dotted}: {err['msg'].removeprefix('Value error, ')}"
        out.append(located.problem(loc, message))
    return out


# --- models ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseModelInfo:
    """A built-in ``base:``: its architecture and the Hugging Face repo it was read from (the
    tokenizer vLLM needs beside a GGUF file)."""

    architecture: Architecture
    hf_repo: str


def _arch(params: int, layers: int, hidden: int, heads: int, kv: int, max_pos: int, vocab: int,
          head_dim: int | None = None) -> Architecture:
    return Architecture(parameters=params, layers=layers, hidden_size=hidden, attention_heads=heads,
                        kv_heads=kv, head_dim=head_dim, max_position=max_pos, vocab_size=vocab)


# Figures from each repo's config.json (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, max_position_embeddings, vocab_size); parameter counts from the model cards
# (safetensors metadata). Mixtral counts every expert: all of them sit in GPU memory.
_BASES: tuple[tuple[str, BaseModelInfo], ...] = (
    ("llama-2-7b", BaseModelInfo(_arch(6_738_415_616, 32, 4096, 32, 32, 4096, 32000),
                                 "meta-llama/Llama-2-7b-hf")),
    ("llama-2-13b", BaseModelInfo(_arch(13_015_864_320, 40, 5120, 40, 40, 4096, 32000),
                                  "meta-llama/Llama-2-13b-hf")),
    ("llama-2-70b", BaseModelInfo(_arch(68_976_648_192, 80, 8192, 64, 8, 4096, 32000),
                                  "meta-llama/Llama-2-70b-hf")),
    ("llama-3-8b", BaseModelInfo(_arch(8_030_261_248, 32, 4096, 32, 8, 8192, 128256),
                                 "meta-llama/Meta-Llama-3-8B")),
    ("llama-3-70b", BaseModelInfo(_arch(70_553_706_496, 80, 8192, 64, 8, 8192, 128256),
                                  "meta-llama/Meta-Llama-3-70B")),
    ("llama-3.1-8b", BaseModelInfo(_arch(8_030_261_248, 32, 4096, 32, 8, 131072, 128256),
                                   "meta-llama/Llama-3.1-8B")),
    ("llama-3.1-70b", BaseModelInfo(_arch(70_553_706_496, 80, 8192, 64, 8, 131072, 128256),
                                    "meta-llama/Llama-3.1-70B")),
    ("mistral-7b", BaseModelInfo(_arch(7_241_732_096, 32, 4096, 32, 8, 32768, 32000),
                                 "mistralai/Mistral-7B-v0.1")),
    ("mixtral-8x7b", BaseModelInfo(_arch(46_702_792_704, 32, 4096, 32, 8, 32768, 32000),
                                   "mistralai/Mixtral-8x7B-v0.1")),
    ("qwen2.5-7b", BaseModelInfo(_arch(7_615_616_512, 28, 3584, 28, 4, 131072, 152064),
                                 "Qwen/Qwen2.5-7B")),
    ("qwen2.5-72b", BaseModelInfo(_arch(72_706_203_648, 80, 8192, 64, 8, 131072, 152064),
                                  "Qwen/Qwen2.5-72B")),
    # XLM-RoBERTa large: config.json says max_position_embeddings 8194, of which 2 are the
    # padding offset RoBERTa reserves, so 8192 tokens of input.
    ("bge-m3", BaseModelInfo(_arch(567_754_752, 24, 1024, 16, 16, 8192, 250002), "BAAI/bge-m3")),
)
BASE_MODELS: Mapping[str, BaseModelInfo] = MappingProxyType(dict(_BASES))


def find_base(name: str) -> BaseModelInfo | None:
    """The built-in model ``name`` (case-insensitive), or None."""
    return BASE_MODELS.get(name.strip().lower())
