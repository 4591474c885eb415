"""Where a model's architecture comes from: ``base:`` (the built-in catalog), ``architecture:``,
or a local ``modelPath`` (a Hugging Face ``config.json`` or a GGUF file's header).

Reads local files only; a remote ``modelPath`` (s3://, hf://, ...) is never fetched, so such a
model must say ``base:`` or ``architecture:``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any

from pydantic import ValidationError

from llmmodel.catalog import BASE_MODELS, find_base
from llmmodel.spec import Architecture, LoadedModel
from routing.yamlsrc import read_text

REMOTE_SCHEMES = ("s3://", "gs://", "hf://", "pvc://")
MAX_CONFIG = 1 << 20
"""The largest ``config.json`` read (1 MiB; Hugging Face's are a few kilobytes)."""
MAX_INDEX = 64 << 20
"""The largest ``model.safetensors.index.json`` read (64 MiB; a 405B model's is about 100 KiB)."""

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float": 4, "half": 2, "float8_e4m3fn": 1}
_GATED_ACTS = ("silu", "swiglu", "geglu", "gelu_pytorch_tanh_gated")


def is_remote(model_path: str) -> bool:
    return model_path.startswith(REMOTE_SCHEMES)


def local_path(model: LoadedModel) -> str:
    """``modelPath`` as a file name: relative paths are relative to the model's YAML file."""
    path = model.spec.model_path
    if os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(model.located.source)), path)


def resolve_architecture(model: LoadedModel) -> Architecture:
    """The architecture the planner sizes ``model`` by. Raises :class:`ConfigError` with one
    ``FILE:LINE`` problem when none can be found."""
    spec = model.spec
    if spec.architecture is not None and spec.base is not None:
        raise model.error(("spec", "architecture"), "give base: or architecture:, not both")
    if spec.architecture is not None:
        return spec.architecture
    if spec.base is not None:
        info = find_base(spec.base)
        if info is None:
            names = list(BASE_MODELS)
            close = difflib.get_close_matches(spec.base.lower(), names, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise model.error(("spec", "base"), (
                f"unknown base {spec.base!r}: {hint}the catalog has {', '.join(names)} "
                "(or describe it under architecture:)"))
        return info.architecture
    if is_remote(spec.model_path):
        raise model.error(("spec", "modelPath"), (
            f"{spec.model_path!r} is not read by the planner: give base: (a built-in model, like "
            "llama-2-13b) or architecture: (layers, hidden_size, attention_heads, ...)"))
    try:
        return read_local(local_path(model))
    except ValueError as exc:
        raise model.error(("spec", "modelPath"), str(exc)) from None


def read_local(path: str) -> Architecture:
    """The architecture of a local model: a directory (its ``config.json``), a ``config.json``
    or a ``.gguf`` file. Raises ``ValueError`` saying what is missing."""
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if os.path.isfile(config):
            return read_hf_config(config)
        ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if ggufs:
            return read_gguf(os.path.join(path, ggufs[0]))
        raise ValueError(f"{path}: no config.json or .gguf file in this directory; give base: or "
                         "architecture:")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory; give base: or architecture: when the "
                         "weights are elsewhere")
    if path.endswith(".gguf"):
        return read_gguf(path)
    if path.endswith(".json"):
        return read_hf_config(path)
    raise ValueError(f"{path}: not a directory, config.json or .gguf file")


def _architecture(path: str, **fields: Any) -> Architecture:
    try:
        return Architecture.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"{p}: " for p in first["loc"][:1])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{path}: {where}{message}") from None


def read_hf_config(path: str) -> Architecture:
    """A Hugging Face ``config.json``. The parameter count comes from a
    ``model.safetensors.index.json`` beside it (``metadata.total_size`` / bytes per element of
    ``torch_dtype``) or, without one, from the layer shapes (:func:`estimate_parameters`)."""
    try:
        config = json.loads(read_text(path, MAX_CONFIG))
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: cannot read it as JSON: nested too deep") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    if isinstance(config.get("text_config"), dict):  # a multimodal model: size its language model
        config = {**config, **config["text_config"]}
    needed = ("num_hidden_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
    missing = [key for key in needed
               if not isinstance(config.get(key), int) or isinstance(config.get(key), bool)]
    if missing:
        raise ValueError(f"{path}: no integer {', '.join(missing)}; give architecture: instead")
    if config["num_attention_heads"] < 1:
        raise ValueError(f"{path}: num_attention_heads is {config['num_attention_heads']}, not a "
                         "head count; give architecture: instead")
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or None
    vocab = config.get("vocab_size") or None
    try:
        params = _safetensors_params(path, config) or estimate_parameters(config)
    except (TypeError, ValueError, ArithmeticError) as exc:  # ArithmeticError: 0 heads, overflow
        raise ValueError(f"{path}: cannot count the parameters from its shapes ({exc}); give "
                         "architecture: with parameters") from None
    return _architecture(path, parameters=params, layers=layers, hidden_size=hidden,
                         attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         max_position=config["max_position_embeddings"], vocab_size=vocab)


def _safetensors_params(path: str, config: dict[str, Any]) -> int | None:
    index = os.path.join(os.path.dirname(path), "model.safetensors.index.json")
    if not os.path.lexists(index):
        return None
    try:
        total = json.loads(read_text(index, MAX_INDEX)).get("metadata", {}).get("total_size")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        return None
    element = _DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "float16"), 2)
    return total // element


def estimate_parameters(config: dict[str, Any]) -> int:
    """Parameters from the shapes of a decoder (or encoder) stack: per layer the attention
    projections (q and o: hidden x heads*head_dim; k and v: hidden x kv_heads*head_dim) and the
    MLP (3 matrices hidden x intermediate when gated, as in Llama's SwiGLU; else 2), plus the
    embeddings (twice when the output head is not tied). Norms and biases are left out (<0.1%)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    experts = int(config.get("num_local_experts") or 1)
    gated = str(config.get("hidden_act", "silu")) in _GATED_ACTS
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = (3 if gated else 2) * hidden * intermediate * experts
    vocab = int(config.get("vocab_size") or 0)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return int(config["num_hidden_layers"]) * (attention + mlp) + embeddings


def _field(reader: Any, key: str) -> Any:
    found = reader.fields.get(key)
    if found is None:
        return None
    return found.contents()


def read_gguf(path: str) -> Architecture:
    """A GGUF file's header (llama.cpp's keys: ``{arch}.block_count``, ``.embedding_length``,
    ``.attention.head_count``, ``.attention.head_count_kv``, ``.context_length``); the parameter
    count is the sum of its tensors' element counts. Reads the header and tensor index only
    (the reader memory-maps the file)."""
    from gguf import GGUFReader  # imported here: only local GGUF models need it

    if not os.path.isfile(path):  # a FIFO or device is not memory-mapped
        raise ValueError(f"{path}: not a regular file")
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture in the GGUF header")
    values = {name: _field(reader, f"{arch}.{key}") for name, key in (
        ("layers", "block_count"), ("hidden_size", "embedding_length"),
        ("attention_heads", "attention.head_count"), ("kv_heads", "attention.head_count_kv"),
        ("max_position", "context_length"), ("head_dim", "attention.key_length"))}
    missing = [f"{arch}.{key}" for name, key in (
        ("layers", "block_count"), ("hidden_size", "embedding_length"),
        ("attention_heads", "attention.head_count"), ("max_position", "context_length"))
        if not isinstance(values[name], int)]
    if missing:
        raise ValueError(f"{path}: the GGUF header has no {', '.join(missing)}")
    params = sum(int(math.prod(int(d) for d in tensor.shape)) for tensor in reader.tensors)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else None
    kv_heads = values["kv_heads"] if isinstance(values["kv_heads"], int) else None
    head_dim = values["head_dim"] if isinstance(values["head_dim"], int) else None
    return _architecture(path, parameters=params, layers=values["layers"],
                         hidden_size=values["hidden_size"], attention_heads=values["attention_heads"],
                         kv_heads=kv_heads, head_dim=head_dim, max_position=values["max_position"],
                         vocab_size=vocab or None)
