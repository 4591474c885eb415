"""What a team writes: ``kind: LLMModel`` as strict pydantic models, and its loader.

The loader reads a file (one or more YAML documents), a directory of them, or a Kubernetes
object's dict (the operator), and reports every problem as ``FILE:LINE: message`` with the same
wording as ``llm-sidecar check``.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from routing.errors import ConfigError, Problem
from routing.loader import _pydantic_problems
from routing.schema import LevelLimits, Limit
from routing.units import parse_duration
from routing.yamlsrc import Located, Path, load_yaml

API_VERSION = "llm-sidecar.dev/v1alpha1"
KIND = "LLMModel"

Quantization = Literal["fp16", "bf16", "fp8", "int8", "awq", "gptq", "q4_k_m", "q5_k_m", "q8_0"]

_DNS_LABEL = re.compile(r"[a-z]([a-z0-9-]{0,40}[a-z0-9])?")
"""A model name: it names Services, which are DNS-1035 labels (a letter first)."""
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_HF_SEGMENT = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_LOCAL_PATH = re.compile(r"[^\s:]+")
MAX_BYTES = 1 << 50
"""The largest size accepted (1 PiB): far above any GPU's memory, and small enough for a float."""
MAX_COUNT = 10**15
"""The largest parameter count accepted (a quadrillion)."""
_BYTES = re.compile(r"^(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|KB|MB|GB|TB)?$")
_BYTE_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
               "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMBT])?$")
_COUNT_UNITS = {None: 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_bytes(text: str | int) -> int:
    """``40Gi`` (binary), ``40G`` or ``40GB`` (decimal), or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > MAX_BYTES:
            raise ValueError(f"{_short(text)} is too large: at most 1Pi")
        return text
    else:
        match = _BYTES.fullmatch(str(text).strip())
        if not match:
            raise ValueError(f"{_short(text)} is not a size: write it like 40Gi (or 40G, 40GB)")
        value: float = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{_short(text)} is too large: at most 1Pi")
    return int(value)


def parse_count(text: str | int) -> int:
    """``13B``, ``7.2B``, ``560M`` or a plain number (a parameter count)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > MAX_COUNT:
            raise ValueError(f"{_short(text)} is too large: at most 1000T (10^15)")
        return text
    else:
        match = _COUNT.fullmatch(str(text).strip().upper())
        if not match:
            raise ValueError(f"{_short(text)} is not a count: write it like 13B or 560M")
        value: float = float(match.group(1)) * _COUNT_UNITS[match.group(2)]
    if not math.isfinite(value) or value > MAX_COUNT:
        raise ValueError(f"{_short(text)} is too large: at most 1000T (10^15)")
    return int(value)


def _short(text: str | int) -> str:
    """``text`` for a message, a 400-digit number cut short."""
    shown = repr(text) if isinstance(text, str) else str(text)
    return shown if len(shown) <= 40 else f"{shown[:20]}...{shown[-10:]} ({len(shown)} characters)"


def parse_percent(text: str | float) -> float:
    """``99.95%`` or ``99.95`` as the fraction 0.9995."""
    try:
        value = float(str(text).strip().removesuffix("%")) if not isinstance(text, float) else text
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage: write it like 99.9%") from None
    if not 0 < value < 100:
        raise ValueError(f"{text!r}: an availability is above 0% and below 100%, like 99.9%")
    if value < 50:
        # 0.999 is a fraction written where a percentage goes: it would mean 0.999%.
        raise ValueError(f"{text!r} would mean {value:g}%: write the availability as a percentage "
                         "like 99.9%")
    return value / 100


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
            raise ValueError(f"{_short(value)}: a P99 time to first token from 1ms to 600s")
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


def parse_latency(text: str) -> float:
    """``200ms``, ``1.5s`` or ``2m`` in seconds."""
    raw = str(text).strip()
    if raw.endswith("ms"):
        try:
            return float(raw[:-2]) / 1000
        except ValueError:
            raise ValueError(f"{text!r} is not a duration: write it like 200ms or 1.5s") from None
    try:
        return float(raw.removesuffix("s")) if raw.endswith("s") else float(parse_duration(raw))
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: write it like 200ms or 1.5s") from None


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


def check_model_name(value: str) -> None:
    """Raises ``ValueError`` unless ``value`` can name a model's pools and Kubernetes objects."""
    if not _DNS_LABEL.fullmatch(value):
        raise ValueError(f"{value!r}: a model name is lower-case letters, digits and '-', starting "
                         "with a letter, at most 42 characters (it names pools and Kubernetes "
                         "Services)")


_PATH_FORMS = "give s3://BUCKET/KEY, gs://BUCKET/KEY, hf://ORG/NAME, pvc://CLAIM/PATH or a local path"


def check_model_path(value: str) -> None:
    """Raises ``ValueError`` unless ``value`` is a ``modelPath`` of a known form. A ``..``
    segment is refused in every form (it would leave the volume, bucket prefix or directory a
    reader expects the weights under)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if scheme not in ("", "hf", "pvc", "s3", "gs"):
        raise ValueError(f"{value!r}: {_PATH_FORMS}")
    segments = rest.replace("\\", "/").split("/")
    if any(unquote(segment).strip() == ".." for segment in segments):
        raise ValueError(f"{value!r}: a modelPath has no '..' segment")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError(f"{value!r}: a modelPath has no spaces or control characters")
    if scheme == "hf":
        if len(segments) != 2 or not all(_HF_SEGMENT.fullmatch(s) for s in segments):
            raise ValueError(f"{value!r}: write a Hugging Face model as hf://ORG/NAME (letters, digits, "
                             "'.', '_' and '-', not starting with '-')")
    elif scheme == "pvc":
        claim = segments[0]
        if not claim or len(claim) > 253 or not _DNS_SUBDOMAIN.fullmatch(claim):
            raise ValueError(f"{value!r}: write pvc://CLAIM/PATH with CLAIM a PersistentVolumeClaim's "
                             "name (lower-case letters, digits, '-' and '.')")
    elif scheme in ("s3", "gs"):
        if not _BUCKET.fullmatch(segments[0]):
            raise ValueError(f"{value!r}: write {scheme}://BUCKET/KEY with BUCKET a bucket name "
                             "(lower-case letters, digits, '.', '_' and '-')")
    elif scheme or not _LOCAL_PATH.fullmatch(value):
        raise ValueError(f"{value!r}: {_PATH_FORMS}")


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
    """The YAML it was read from; ``located.source`` is its file."""
    base: Path = ()
    """Where the document starts in ``located`` (``()``; a document of a multi-document file is
    its own ``Located``)."""

    @property
    def name(self) -> str:
        return self.doc.metadata.name

    @property
    def spec(self) -> LLMModelSpec:
        return self.doc.spec

    def problem(self, path: Path, message: str) -> Problem:
        """A problem at ``path`` of the document (``("spec", "gpuRequest")``)."""
        return self.located.problem((*self.base, *path), message)

    def error(self, path: Path, message: str) -> ConfigError:
        return ConfigError([self.problem(path, message)])


MODEL_SUFFIXES = (".yaml", ".yml")
MAX_MODEL_FILE = 1 << 20
"""The largest LLMModel file read (1 MiB): a few documents are a few kilobytes."""


def read_text(path: str, limit: int) -> str:
    """A regular file of at most ``limit`` bytes as UTF-8 text; raises ``ValueError`` saying why
    not. A FIFO, a device (a link to /dev/zero) or a huge file is refused before it is opened,
    so a bad file in a watched folder cannot hang the reader or fill its memory."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, device or socket is not read)")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than the {limit} read")
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ValueError(f"more than the {limit} bytes read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


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
