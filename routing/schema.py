"""What operators write: the routing YAML (version 1) as strict pydantic models.

Unknown keys are errors. Cross-references (a model naming a cluster that does not exist,
overlapping names) are checked in :mod:`routing.loader`, which knows the lines.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from routing.units import parse_duration, parse_hostport, parse_rate

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"bad name {value!r}: use letters, digits, '.', '_' and '-'")
    return value


class EnvoySection(Strict):
    listen: str = "0.0.0.0:10000"
    admin: str = "127.0.0.1:9901"
    request_timeout: str = "10m"
    """Longest a whole request may take (long generations); streams are also cut when idle."""
    stream_idle_timeout: str = "5m"
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Bodies above this get a 413 from Envoy (buffered for ext_proc)."""

    @field_validator("listen", "admin")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_hostport(value)
        return value

    @field_validator("admin")
    @classmethod
    def _loopback(cls, value: str) -> str:
        host, port = parse_hostport(value)
        if host != "localhost" and not _is_loopback(host):
            raise ValueError(
                f"the admin interface can stop Envoy and dump its config: listen on loopback, "
                f"like 127.0.0.1:{port} (probes use GET /healthz on the listener)")
        return value

    @field_validator("request_timeout", "stream_idle_timeout")
    @classmethod
    def _duration(cls, value: str) -> str:
        parse_duration(value)
        return value


class ServicesSection(Strict):
    extproc: str = "127.0.0.1:50051"
    ratelimit: str = "127.0.0.1:50052"
    failure_mode_allow: bool = False
    """When extproc cannot be reached: false answers 503 JSON (fail closed), true passes through."""
    ratelimit_failure_mode_deny: bool = False
    """When ratelimit cannot be reached: false admits (fail open), true answers 503."""

    @field_validator("extproc", "ratelimit")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_hostport(value)
        return value


class SimulateSpec(Strict):
    """How ``llm-sidecar up`` runs the simulator of a ``simulate:`` cluster."""

    prefill_ms_per_token: float = Field(default=0.0, ge=0, le=1000)
    decode_ms_per_token: float = Field(default=2.0, ge=0, le=10_000)
    default_output_tokens: int = Field(default=16, ge=1, le=1_000_000)
    embedding_dim: int = Field(default=256, ge=1, le=65_536)


class ClusterSpec(Strict):
    endpoints: Annotated[list[str], Field(min_length=1)]
    max_context: int = Field(gt=0, le=10_000_000)
    simulate: bool | SimulateSpec = False
    """true (or simulator settings): ``llm-sidecar up`` runs a vLLM simulator on each endpoint."""

    @property
    def simulator(self) -> SimulateSpec | None:
        if self.simulate is True:
            return SimulateSpec()
        return self.simulate or None

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        for item in value:
            parse_hostport(item)
        return value


class GuardSpec(Strict):
    """Stop the canary when it is clearly worse than stable (per extproc replica)."""

    min_samples: int = Field(default=50, ge=1)
    """Requests each variant must have finished before the guard judges."""
    max_error_ratio: float = Field(default=2.0, gt=1)
    """Trip when canary error rate > this x max(stable error rate, 1%)."""
    max_ttft_p99_ratio: float = Field(default=2.0, gt=1)
    """Trip when canary p99 time-to-first-token > this x stable's."""


class CanarySpec(Strict):
    model: str
    cluster: str
    percent: float = Field(ge=0, le=100)
    sticky: Literal["api_key", "tenant", "request"] = "api_key"
    guard: GuardSpec | None = None


class CacheSpec(Strict):
    namespace: str
    """Models naming the same namespace share vectors: only safe when they are the same weights."""
    ttl: str = "7d"
    share_with_canary: bool = False
    """true: the model's canary reads and writes this namespace too (same weights, new server);
    false: the canary gets ``<namespace>@<canary model>`` of its own."""

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, value: str) -> str:
        parse_duration(value)
        return value


class ModelSpec(Strict):
    kind: Literal["chat", "embedding"] = "chat"
    clusters: Annotated[list[str], Field(min_length=1)]
    default_max_tokens: int = Field(default=256, ge=0, le=10_000_000)
    tokenizer: str | None = None
    canary: CanarySpec | None = None
    cache: CacheSpec | None = None


class AuthSection(Strict):
    required: bool = False
    tenant_header: str = "x-tenant-id"

    @field_validator("tenant_header")
    @classmethod
    def _header(cls, value: str) -> str:
        lowered = value.lower()
        if not re.match(r"^[a-z0-9-]+$", lowered) or lowered.startswith("x-llm-"):
            raise ValueError(f"bad tenant_header {value!r}: a plain header name, not x-llm-*")
        return lowered


class ApiKey(Strict):
    name: str
    sha256: str
    tenant: str = "default"

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not re.match(r"^[0-9a-fA-F]{64}$", value):
            raise ValueError("sha256 must be 64 hex digits: the sha256 of the secret key")
        return value.lower()

    @field_validator("name", "tenant")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)


class Limit(Strict):
    requests: str | None = None
    burst: int | None = Field(default=None, gt=0)
    tokens: str | None = None

    @field_validator("requests", "tokens")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rate(value)
        return value


class LevelLimits(Strict):
    default: Limit | None = None
    overrides: dict[str, Limit] = Field(default_factory=dict)


class RateLimits(Strict):
    api_key: LevelLimits | None = None
    tenant: LevelLimits | None = None
    model: LevelLimits | None = None
    on_backend_error: Literal["allow", "deny"] = "allow"


class PrioritySection(Strict):
    high_below: float = Field(default=500, ge=0)
    low_from: float = Field(default=5000, ge=0)
    inject: bool = False


class RoutingConfig(Strict):
    version: Literal[1]
    envoy: EnvoySection = Field(default_factory=EnvoySection)
    services: ServicesSection = Field(default_factory=ServicesSection)
    clusters: Annotated[dict[str, ClusterSpec], Field(min_length=1)]
    models: Annotated[dict[str, ModelSpec], Field(min_length=1)]
    auth: AuthSection = Field(default_factory=AuthSection)
    api_keys: list[ApiKey] = Field(default_factory=list)
    rate_limits: RateLimits | None = None
    priority: PrioritySection = Field(default_factory=PrioritySection)

    @field_validator("clusters", "models")
    @classmethod
    def _names(cls, value: dict[str, object]) -> dict[str, object]:
        for name in value:
            _check_name(str(name))
        return value
