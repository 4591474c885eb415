"""What a team writes: ``kind: LLMModel`` as strict pydantic models, and its loader.

The loader reads a file (one or more YAML documents), a directory of them, or a Kubernetes
object's dict (the operator), and reports every problem as ``FILE:LINE: message`` with the same
wording as ``llm-sidecar check``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmmodel.values import (
    check_model_name,
    check_model_path,
    parse_bytes,
    parse_count,
    parse_latency,
    parse_percent,
    shortened,
)
from routing.errors import ConfigError, Problem
from routing.loader import _pydantic_problems
from routing.schema import LevelLimits, Limit
from routing.yamlsrc import Located, Path, load_yaml, read_text

API_VERSION = "llm-sidecar.dev/v1alpha1"
KIND = "LLMModel"

Quantization = Literal["fp16", "bf16", "fp8", "int8", "awq", "gptq", "q4_k_m", "q5_k_m", "q8_0"]

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              use_attribute_docstrings=True)


class Sla(Strict):
    p99_latency: str = Field(alias="p99Latency")
    """Time to first token at the 99th percentile, like 200ms or 1.5s."""
    availability: str | float = "99.9%"
    """Share of requests answered without a server error, like 99.95%."""

    @field_validator("p99_latency")
    @classmethod
    def _latency(cls, value: str) -> str:
        seconds = parse_latency(value)
        if not 0 < seconds <= 600:
            raise ValueError(f"{shortened(value)}: a P99 time to first token from 1ms to 600s")
        return value

    @field_validator("availability")
    @classmethod
    def _availability(cls, value: str | float) -> str | float:
        parse_percent(value)
        return value

    @property
    def p99_latency_s(self) -> float:
        return parse_latency(self.p99_latency)

    @property
    def availability_fraction(self) -> float:
        return parse_percent(self.availability)


class Architecture(Strict):
    """The model's shape, when no built-in ``base`` or local file gives it."""

    parameters: str | int
    """Parameter count, like 13B (a mixture of experts: all experts' parameters)."""
    layers: int = Field(ge=1, le=1000)
    hidden_size: int = Field(ge=1, le=1_000_000)
    attention_heads: int = Field(ge=1, le=10_000)
    kv_heads: int | None = Field(default=None, ge=1, le=10_000)
    """Key/value heads (grouped-query attention); default: ``attention_heads``."""
    head_dim: int | None = Field(default=None, ge=1, le=100_000)
    """Default: ``hidden_size / attention_heads``."""
    max_position: int = Field(ge=1, le=100_000_000)
    """The longest context the model was trained for (``max_position_embeddings``)."""
    vocab_size: int | None = Field(default=None, ge=1, le=10_000_000)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: str | int) -> str | int:
        if parse_count(value) < 1_000_000:
            raise ValueError(f"{value!r}: at least 1M parameters")
        return value

    @model_validator(mode="after")
    def _heads(self) -> Architecture:
        if self.kv_heads is not None and self.attention_heads % self.kv_heads:
            raise ValueError("attention_heads must be a multiple of kv_heads")
        if self.head_size < 1:
            # the KV cache per token is a multiple of the head size: 0 would size it as free
            raise ValueError(f"hidden_size {self.hidden_size} / attention_heads {self.attention_heads} "
                             "gives a head size of 0: give head_dim, or a hidden_size of at least "
                             "attention_heads")
        return self

    @property
    def parameter_count(self) -> int:
        return parse_count(self.parameters)

    @property
    def kv_head_count(self) -> int:
        return self.kv_heads or self.attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.attention_heads


class Replicas(Strict):
    min: int = Field(default=1, ge=0, le=10_000)
    max: int = Field(default=1, ge=1, le=10_000)

    @model_validator(mode="after")
    def _order(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class ModelLimits(Strict):
    """Rate limits in the routing YAML's grammar: ``model`` is this model's own limit; ``tenant``
    and ``api_key`` are merged into the gateway's levels of those names."""

    model: Limit | None = None
    tenant: LevelLimits | None = None
    api_key: LevelLimits | None = None


class ModelCanary(Strict):
    model: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")
    """The canary's model name: another LLMModel declared beside this one that says
    ``canaryOf: <this model>`` serves it, or else a pool ``<name>-canary`` planned as this
    model's longest pool, serving ``modelPath``. A declared model without that ``canaryOf`` is
    an error: it is served as a model of its own."""
    percent: float = Field(ge=0, le=100)
    sticky: Literal["api_key", "tenant", "request"] = "api_key"
    model_path: str | None = Field(default=None, alias="modelPath")
    """The canary's weights when no LLMModel declares it (default: this model's)."""

    @field_validator("model_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            check_model_path(value)
        return value


class LLMModelSpec(Strict):
    model_path: str = Field(alias="modelPath")
    """Where the weights are: s3://, gs://, hf://ORG/NAME, pvc://CLAIM/PATH, or a local path."""
    quantization: Quantization = "fp16"
    gpu_request: str | int = Field(alias="gpuRequest")
    """GPU memory per replica, like 40Gi (not cards: the planner picks the GPUs)."""
    sla: Sla
    base: str | None = None
    """The architecture from the built-in catalog (``llm-sidecar plan --help`` lists it)."""
    architecture: Architecture | None = None
    kind: Literal["chat", "embedding"] = "chat"
    contexts: Annotated[list[int], Field(min_length=1, max_length=8)] | None = None
    """One pool per entry (default: 2048 and the model's longest)."""
    replicas: Replicas = Field(default_factory=Replicas)
    gpu_class: str | None = Field(default=None, alias="gpuClass")
    """Only this GPU of the catalog (default: the cheapest that fits)."""
    limits: ModelLimits | None = None
    canary: ModelCanary | None = None
    canary_of: str | None = Field(default=None, alias="canaryOf")
    """The stable model this one is the canary of: that LLMModel names this one under
    ``canary.model``. This model then serves only that model's canary share (it gets no model
    entry of its own). Without it, a model another LLMModel names as its canary is an error, so
    declaring a canary never takes a model away from its clients."""

    @field_validator("model_path")
    @classmethod
    def _path(cls, value: str) -> str:
        check_model_path(value)
        return value

    @field_validator("canary_of")
    @classmethod
    def _canary_of(cls, value: str | None) -> str | None:
        if value is not None:
            check_model_name(value)
        return value

    @field_validator("gpu_request")
    @classmethod
    def _gpu_request(cls, value: str | int) -> str | int:
        if parse_bytes(value) < 1 << 30:
            raise ValueError(f"{value!r}: at least 1Gi of GPU memory")
        return value

    @field_validator("contexts")
    @classmethod
    def _contexts(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if any(c < 128 or c > 10_000_000 for c in value):
            raise ValueError("each context is from 128 to 10,000,000 tokens")
        if len(set(value)) != len(value):
            raise ValueError("a context is listed twice")
        return sorted(value)

    @property
    def gpu_request_bytes(self) -> int:
        return parse_bytes(self.gpu_request)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    namespace: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        check_model_name(value)
        return value


class LLMModelDoc(Strict):
    api_version: Literal["llm-sidecar.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["LLMModel"]
    metadata: Metadata
    spec: LLMModelSpec


@dataclass(frozen=True)
class LoadedModel:
    """One validated LLMModel and where it came from (for ``FILE:LINE`` in later problems)."""

    doc: LLMModelDoc
    located: Located
    """The YAML it was read from (a document of a multi-document file is its own);
    ``located.source`` is its file."""

    @property
    def name(self) -> str:
        return self.doc.metadata.name

    @property
    def spec(self) -> LLMModelSpec:
        return self.doc.spec

    def problem(self, path: Path, message: str) -> Problem:
        """A problem at ``path`` of the document (``("spec", "gpuRequest")``)."""
        return self.located.problem(path, message)

    def error(self, path: Path, message: str) -> ConfigError:
        return ConfigError([self.problem(path, message)])


MODEL_SUFFIXES = (".yaml", ".yml")
MAX_MODEL_FILE = 1 << 20
"""The largest LLMModel file read (1 MiB): a few documents are a few kilobytes."""


def model_files(paths: Iterable[str]) -> list[str]:
    """The files ``paths`` name: a file as it is, a directory as its ``*.yaml``/``*.yml``
    (sorted, not recursive, hidden files skipped)."""
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            out += sorted(os.path.join(path, name) for name in os.listdir(path)
                          if name.endswith(MODEL_SUFFIXES) and not name.startswith("."))
        else:
            out.append(path)
    return out


def validate_model(located: Located) -> LoadedModel:
    """One LLMModel document; raises :class:`ConfigError` with every problem."""
    if not isinstance(located.data, dict):
        raise ConfigError([located.problem((), "an LLMModel is a mapping with apiVersion: "
                                                 f"{API_VERSION}, kind: {KIND}, metadata, spec")])
    try:
        doc = LLMModelDoc.model_validate(located.data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_problems(exc, located)) from None
    model = LoadedModel(doc, located)
    problems = _canary_shape(model)
    if problems:
        raise ConfigError(problems)
    return model


def _canary_shape(model: LoadedModel) -> list[Problem]:
    """What one document alone says wrong of its canary: itself as canary or stable, or a
    canary model that has a canary of its own (a chain)."""
    spec, name = model.spec, model.name
    problems: list[Problem] = []
    if spec.canary is not None and spec.canary.model == name:
        problems.append(model.problem(("spec", "canary", "model"), (
            f"{name!r} cannot be its own canary: name another model (a new version)")))
    if spec.canary_of == name:
        problems.append(model.problem(("spec", "canaryOf"), (
            f"{name!r} cannot be the canary of itself: name the stable model it is the canary of")))
    elif spec.canary_of is not None and spec.canary is not None:
        problems.append(model.problem(("spec", "canary"), (
            f"{name!r} is the canary of {spec.canary_of!r} (canaryOf), so it serves only that "
            "model's canary share and has no canary of its own")))
    return problems


def canary_problems(models: Sequence[LoadedModel]) -> list[Problem]:
    """The canary links between models declared together. A declared model is another's canary
    only when it says so with ``canaryOf``: naming a model of its own as a canary would take it
    from its clients (requests for it would get 404). A ``canaryOf`` whose model is not
    declared beside it is no problem (the operator plans each model alone first): the model is
    then served as a model of its own."""
    by_name = {m.name: m for m in models}
    problems: list[Problem] = []
    for model in models:
        canary = model.spec.canary
        target = by_name.get(canary.model) if canary is not None else None
        if canary is not None and target is not None and target is not model \
                and target.spec.canary_of != model.name:
            problems.append(model.problem(("spec", "canary", "model"), (
                f"{canary.model!r} is served as a model of its own; to make it this model's canary, "
                f"set canaryOf: {model.name} in its LLMModel")))
        stable_name = model.spec.canary_of
        stable = by_name.get(stable_name) if stable_name is not None else None
        if stable is None or stable is model:
            continue
        if stable.spec.canary_of is not None:
            problems.append(model.problem(("spec", "canaryOf"), (
                f"{stable_name!r} is itself the canary of {stable.spec.canary_of!r}: a canary's "
                "stable model is a model served on its own")))
        elif stable.spec.canary is None or stable.spec.canary.model != model.name:
            named = f"names {stable.spec.canary.model!r}" if stable.spec.canary else "names none"
            problems.append(model.problem(("spec", "canaryOf"), (
                f"{stable_name!r} does not name {model.name!r} as its canary ({named}): set "
                f"canary: {{model: {model.name}, percent: ...}} in its LLMModel, or remove canaryOf")))
    return problems


def load_models(paths: Sequence[str]) -> list[LoadedModel]:
    """Every LLMModel in ``paths`` (files or directories; a file may hold several documents
    separated by ``---``). Raises :class:`ConfigError` with every problem of every file, and
    for a model name declared twice."""
    problems: list[Problem] = []
    models: list[LoadedModel] = []
    seen: dict[str, LoadedModel] = {}
    for path in model_files(paths):
        try:
            text = read_text(path, MAX_MODEL_FILE)
        except ValueError as exc:
            problems.append(Problem(path, 1, str(exc)))
            continue
        for located in _documents(text, path, problems):
            try:
                model = validate_model(located)
            except ConfigError as err:
                problems += err.problems
                continue
            if model.name in seen:
                first = seen[model.name]
                problems.append(model.problem(("metadata", "name"), (
                    f"model {model.name!r} is declared twice (first at "
                    f"{first.located.source}:{first.located.line_of(('metadata', 'name'))})")))
                continue
            seen[model.name] = model
            models.append(model)
    if problems:
        raise ConfigError(problems)
    return models


def _documents(text: str, path: str, problems: list[Problem]) -> list[Located]:
    """Each ``---`` document of ``text`` as its own :class:`Located` (lines of the whole file)."""
    out: list[Located] = []
    offset = 0
    for chunk in re.split(r"(?m)^---[ \t]*$", text):
        lines = chunk.count("\n")
        if chunk.strip() and not all(line.strip().startswith("#") or not line.strip()
                                     for line in chunk.splitlines()):
            try:
                located = load_yaml("\n" * offset + chunk, path)
            except ConfigError as err:
                problems += err.problems
            else:
                if located.data is not None:
                    out.append(located)
        offset += lines
    return out


def model_from_object(obj: dict[str, Any], source: str) -> LoadedModel:
    """An LLMModel object as the Kubernetes API returns it (the operator); problems name
    ``source`` (``namespace/name``) with line 1."""
    data = {key: obj[key] for key in ("apiVersion", "kind", "metadata", "spec") if key in obj}
    if isinstance(data.get("metadata"), dict):
        data["metadata"] = {k: v for k, v in data["metadata"].items()
                            if k in ("name", "namespace")}
    return validate_model(Located(source, data))
