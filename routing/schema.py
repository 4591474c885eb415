"""What operators write: the routing YAML (version 1) as strict pydantic models.

Unknown keys are errors. Cross-references (a model naming a cluster that does not exist,
overlapping names) are checked in :mod:`routing.loader`, which knows the lines.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from routing.picker_schema import EndpointPickerSpec
from routing.units import parse_duration, parse_hostport, parse_rate, parse_service_address

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
TENANT_RULE = "1 to 64 ASCII letters, digits, '.', '_' or '-'"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class Strict(BaseModel):
    # Attribute docstrings become descriptions in the JSON Schema (editor hovers).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_tenant(value: str) -> bool:
    """Whether ``value`` may name a tenant (docs: Identity, canaries and priority). Tenants go
    into headers, Redis keys, descriptor values and logs, so the alphabet is small and nothing
    is truncated to fit: a cut-down value could collide with a real tenant."""
    return _TENANT.fullmatch(value) is not None


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"bad name {value!r}: use letters, digits, '.', '_' and '-'")
    return value


MAX_ENVOY_DURATION_S = 3650 * 86400
"""The longest timeout accepted: ten years, far below protobuf's Duration range, which
Envoy refuses beyond (render would write a bootstrap Envoy does not start)."""


class EnvoySection(Strict):
    listen: str = "0.0.0.0:10000"
    """host:port of Envoy's listener for clients (OpenAI API, and GET /healthz for probes)."""
    admin: str = "127.0.0.1:9901"
    """host:port of Envoy's admin interface: loopback only."""
    request_timeout: str = "10m"
    """Longest time to receive a whole request; responses are never cut by a total timeout."""
    stream_idle_timeout: str = "5m"
    """A stream (an SSE generation included) with no bytes for this long is ended."""
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=4_294_967_295)
    """Bodies above this get a 413 from Envoy (buffered for ext_proc)."""
    max_connections: int = Field(default=10000, ge=1)
    """Client connections Envoy holds open at once; past it new ones are closed on accept
    (stat ``downstream_global_cx_overflow``) instead of running Envoy out of file descriptors.
    The admin interface is not counted."""
    max_heap_bytes: int | None = Field(default=None, ge=1024 * 1024)
    """Envoy's heap limit (the overload manager's fixed_heap monitor): at 90% of it Envoy
    returns freed memory to the system and resets the streams holding the largest buffers, at
    95% it answers new requests 503 ``server_overloaded``. Set it below the container's memory
    limit (about 75%); unset: no heap monitor (Envoy cannot know its container's limit)."""
    max_concurrent_streams: int = Field(default=100, ge=1, le=2_147_483_647)
    """Streams one HTTP/2 client connection may have open at once. Each may buffer a whole
    body (``max_request_bytes``), so this times that is what one connection can make Envoy
    hold."""
    dynamic_pools: bool = False
    """Envoy reads the pools' clusters and routes from ``xds/`` files beside its bootstrap and
    watches them: ``render`` into the same folder applies cluster and endpoint changes without
    restarting Envoy (``llm-sidecar up --models`` works this way). false: every pool is in the
    bootstrap, and a pool change needs a render and an Envoy restart."""

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
        if parse_duration(value) > MAX_ENVOY_DURATION_S:
            raise ValueError(f"{value} is longer than Envoy takes (at most 3650d)")
        return value


class ServicesTls(Strict):
    """How Envoy verifies (and, with a client certificate, authenticates to) the services."""

    ca_file: str
    """CA bundle that signed the services' certificates."""
    server_name: str | None = None
    """SNI sent, and the DNS name the services' certificates must carry (unchecked if unset)."""
    cert_file: str | None = None
    """Envoy's client certificate, for services that require one (mutual TLS)."""
    key_file: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> ServicesTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class ServicesSection(Strict):
    extproc: str = "127.0.0.1:50051"
    """host:port where Envoy reaches the ext_proc gRPC service."""
    ratelimit: str = "127.0.0.1:50052"
    """host:port where Envoy reaches the rate-limit gRPC service."""
    failure_mode_allow: bool = False
    """When extproc cannot be reached: false answers 503 JSON (fail closed), true passes through."""
    fallback_cluster: str | None = None
    """With ``failure_mode_allow``: where requests extproc could not route go (else a 503)."""
    ratelimit_failure_mode_deny: bool = False
    """When ratelimit cannot be reached: false admits (fail open), true answers 503."""
    extproc_timeout_s: float = Field(default=5.0, gt=0, le=60)
    """How long Envoy waits for each extproc answer (ext_proc's ``message_timeout``) before
    ``failure_mode_allow`` applies: what a request sent to a hung replica waits. Counting a
    32K-token prompt with a real tokenizer takes tens of milliseconds."""
    ratelimit_timeout_s: float = Field(default=0.25, gt=0, le=60)
    """How long Envoy waits for a rate-limit decision before ``ratelimit_failure_mode_deny``
    applies (the service itself answers within its Redis deadline, 50 ms by default)."""

    tls: ServicesTls | None = None
    """Envoy talks to extproc and ratelimit over TLS (the services need
    ``LLM_SIDECAR_GRPC_TLS_CERT_FILE`` and ``..._KEY_FILE``)."""

    @field_validator("extproc", "ratelimit")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_service_address(value)
        return value


class SimulateSpec(Strict):
    """How ``llm-sidecar up`` runs the simulator of a ``simulate:`` cluster."""

    prefill_ms_per_token: float = Field(default=0.0, ge=0, le=1000)
    decode_ms_per_token: float = Field(default=2.0, ge=0, le=10_000)
    default_output_tokens: int = Field(default=16, ge=1, le=1_000_000)
    """Tokens a simulated answer runs to when its request sets no max_tokens."""
    natural_stop: bool = False
    """Every answer ends at ``default_output_tokens`` (finish ``stop``) even when its
    ``max_tokens`` allows more, as a real model's end-of-sequence token ends it; false: a
    request's ``max_tokens`` is always reached."""
    stream_interval: int = Field(default=1, ge=1, le=1024)
    """Tokens per streamed chunk, as vLLM's ``--stream-interval`` (and speculative decoding)."""
    embedding_dim: int = Field(default=256, ge=1, le=65_536)
    speed: float = Field(default=1.0, gt=0, le=1000)
    """GPU speed factor of the cluster's simulated pods: prefill and decode times are divided
    by it (2.0: a GPU twice as fast), for pools of uneven GPUs."""
    kv_cache_tokens: int | None = Field(default=None, ge=1, le=1_000_000_000)
    """KV cache of each simulated pod in tokens: a request waits while the running requests'
    prompts and output budgets leave no room for its own; default 8 x ``max_context``."""
    drift: float = Field(default=0.0, ge=0, le=1)
    """Share of each answer's words the simulated pods change (a canary that answers
    differently, for the canary verdict); 0: the same prompt gets the same answer on every
    pod."""
    max_num_seqs: int | None = Field(default=None, ge=1, le=65_536)
    """Sequences each simulated pod runs at once (vLLM's ``--max-num-seqs``; the rest wait);
    default 256."""
    engine: Literal["vllm", "sglang", "tgi", "llamacpp", "trtllm"] = "vllm"
    """Which engine the simulated pods pass for: its metric names and ``/metrics`` text, and the
    JSON shape of its stream chunks (``llm-sidecar sim --engine``)."""

    def sim_flags(self) -> list[str]:
        """The ``llm-sidecar sim`` flags these settings stand for (besides host, port, name and
        ``--max-model-len``)."""
        flags = ["--prefill-ms-per-token", str(self.prefill_ms_per_token),
                 "--decode-ms-per-token", str(self.decode_ms_per_token),
                 "--default-output-tokens", str(self.default_output_tokens),
                 "--embedding-dim", str(self.embedding_dim),
                 "--speed", str(self.speed), "--engine", self.engine]
        if self.kv_cache_tokens is not None:
            flags += ["--kv-cache-tokens", str(self.kv_cache_tokens)]
        if self.max_num_seqs is not None:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.drift:
            flags += ["--drift", str(self.drift)]
        if self.natural_stop:
            flags.append("--natural-stop")
        if self.stream_interval != 1:
            flags += ["--stream-interval", str(self.stream_interval)]
        return flags


class ClusterSpec(Strict):
    endpoints: Annotated[list[str], Field(min_length=1)]
    """host:port of each vLLM server of the pool (IPs, or DNS names such as a headless Service)."""
    max_context: int = Field(gt=0, le=10_000_000)
    """The longest context (prompt + output) the pool serves: its vLLM --max-model-len."""
    simulate: bool | SimulateSpec = False
    """true (or simulator settings): ``llm-sidecar up`` runs a vLLM simulator on each endpoint."""
    upstream_api_key_env: str | None = None
    """Name of the environment variable, in Envoy's process, holding this pool's own vLLM API
    key (``vllm serve --api-key``): sent upstream as ``Authorization: Bearer``. Clients'
    credentials never reach a pool either way."""
    endpoint_picker: EndpointPickerSpec | None = None
    """extproc picks the pod from each pod's live vLLM metrics (``{}``: defaults); absent:
    Envoy's least-request balancing."""
    cost_per_1k_tokens: float | None = Field(default=None, ge=0, le=1_000_000)
    """What 1,000 tokens this pool generates cost (any currency): the canary verdict compares
    cost per request with it; unset, completion tokens are compared."""

    @field_validator("upstream_api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            raise ValueError(f"bad upstream_api_key_env {value!r}: an environment variable "
                             "name, letters, digits and '_', not starting with a digit")
        return value

    def cost_of(self, tokens: int) -> float:
        """What ``tokens`` generated tokens cost on this pool: times ``cost_per_1k_tokens`` /
        1000 when it is set, else the tokens themselves (the canary verdict's cost)."""
        price = self.cost_per_1k_tokens
        return tokens * price / 1000 if price is not None else float(tokens)

    @property
    def simulator(self) -> SimulateSpec | None:
        if self.simulate is True:
            return SimulateSpec()
        return self.simulate or None

    @property
    def declared_seqs(self) -> int | None:
        """Sequences each pod runs at once, as the config says: ``endpoint_picker.max_num_seqs``,
        else the simulated pods' own ``simulate.max_num_seqs``; None when neither says."""
        picker = self.endpoint_picker
        if picker is not None and picker.max_num_seqs is not None:
            return picker.max_num_seqs
        sim = self.simulator
        return sim.max_num_seqs if sim is not None else None

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


class CompareSpec(Strict):
    """Judge the canary on what it answers (docs: Canary verdict): a share of stable requests is
    replayed on the canary model out of band, as a shadow, and each pair compared."""

    shadow_percent: float = Field(default=2.0, gt=0, le=100)
    """Share of finished stable chat and completions requests replayed on the canary."""
    min_samples: int = Field(default=30, ge=2, le=1_000_000)
    """Pairs compared before a verdict other than ``hold``."""
    rouge_l_min: float = Field(default=0.5, ge=0, le=1)
    """Rollback when the canary's mean ROUGE-L F1 against stable's answers is below this."""
    ttft_p99_max_ratio: float = Field(default=1.2, gt=0)
    """Rollback when the canary's P99 time to first token over stable's is above this."""
    cost_max_ratio: float = Field(default=1.2, gt=0)
    """Rollback when the canary's mean cost per request over stable's is above this (completion
    tokens, times each pool's ``cost_per_1k_tokens`` when set)."""
    action: Literal["report", "rollback"] = "report"
    """``rollback``: a rollback verdict stops the canary as its guard does (every replica and
    worker, kept across restarts); ``report``: the verdict is only shown."""
    exclude_tenants: tuple[str, ...] = Field(default=(), max_length=10_000)
    """Tenants whose requests are never replayed."""
    max_shadows_per_s: float = Field(default=5.0, gt=0, le=10_000)
    """The shadows' own budget, per extproc process: past it a pair is skipped. Shadows are
    charged to no client's limits."""
    max_in_flight: int = Field(default=4, ge=1, le=1024)
    """Shadows open at once per extproc process; more are skipped."""
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    """How long a shadow may take before it is dropped (no pair)."""


class CanarySpec(Strict):
    model: str
    """The model name the canary serves; the request body's model is rewritten to it."""
    cluster: str
    """The pool the canary runs on."""
    percent: float = Field(ge=0, le=100)
    """Share of sticky keys sent to the canary, 0 to 100."""
    sticky: Literal["api_key", "tenant", "request"] = "api_key"
    """What keeps a client on one variant: its API key, its tenant, or nothing (per request)."""
    guard: GuardSpec | None = None
    compare: CompareSpec | None = None
    """Shadow a share of stable requests on the canary and judge it on quality, latency and
    cost (``{}``: the defaults)."""

    @field_validator("percent", mode="before")
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # YAML's yes/no/on/off: pydantic would read 1 or 0
            raise ValueError("a percentage is a number, not true or false")
        return value


class CacheSpec(Strict):
    namespace: str
    """Models naming the same namespace share vectors: only safe when they are the same weights."""
    ttl: str = "7d"
    share_with_canary: bool = False
    """true: the model's canary reads and writes this namespace too (same weights, new server);
    false: the canary gets ``<namespace>@<canary model>`` of its own."""
    scope: Literal["shared", "tenant"] = "shared"
    """shared: every tenant reads what any tenant cached (more hits, but ``x-llm-cache`` tells
    a tenant whether another embedded an input); tenant: entries are per tenant."""

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, value: str) -> str:
        parse_duration(value)
        return value


class MediaTokensSpec(Strict):
    """Prompt tokens assumed per media item of a chat message (vLLM's processor decides the
    real number, which the usage settles); set them to the model's figures."""

    image: int = Field(default=1024, ge=0, le=1_000_000)
    audio: int = Field(default=1024, ge=0, le=1_000_000)
    video: int = Field(default=4096, ge=0, le=10_000_000)


class ModelSpec(Strict):
    kind: Literal["chat", "embedding"] = "chat"
    clusters: Annotated[list[str], Field(min_length=1)]
    """Pools serving the model; the one with the smallest max_context that fits wins."""
    default_max_tokens: int = Field(default=256, ge=0, le=10_000_000)
    """Output budget assumed when a request sets no max_tokens; under an enforcing token limit
    it is also written into the request vLLM gets, so the reservation bounds the answer."""
    tokenizer: str | None = None
    """Path to a Hugging Face tokenizer.json; without it prompts are estimated (high)."""
    media_tokens: MediaTokensSpec = MediaTokensSpec()
    """Tokens each image, audio clip or video of a chat prompt counts for (reservation and
    context length): text alone would let a multimodal prompt reserve next to nothing."""
    canary: CanarySpec | None = None
    cache: CacheSpec | None = None
    prefix_cache_scope: Literal["shared", "tenant"] = "shared"
    """shared: vLLM's prefix cache serves any tenant the KV blocks another tenant's prompt left
    (most hits, but a tenant can time whether another sent a prompt recently); tenant: extproc
    salts each request with its tenant (vLLM's ``cache_salt``), so blocks are reused within a
    tenant only."""

    @model_validator(mode="after")
    def _prefix_cache_scope(self) -> ModelSpec:
        if self.kind == "embedding" and self.prefix_cache_scope != "shared":
            raise ValueError("prefix_cache_scope is for chat models; an embedding model's "
                             "cache scope is cache.scope")
        return self


class AuthSection(Strict):
    required: bool = False
    """true: a key not listed under api_keys gets 401 (the production setting). false (open
    mode): unlisted keys and anonymous callers name their own tenant with tenant_header."""
    tenant_header: str = "x-tenant-id"
    """Read only for unlisted keys and anonymous callers; a value naming a listed key's tenant
    is ignored (the caller gets tenant default), a value outside the tenant alphabet is a 400."""

    @field_validator("tenant_header")
    @classmethod
    def _header(cls, value: str) -> str:
        lowered = value.lower()
        if not re.match(r"^[a-z0-9-]+$", lowered) or lowered.startswith("x-llm-"):
            raise ValueError(f"bad tenant_header {value!r}: a plain header name, not x-llm-*")
        return lowered


class ApiKey(Strict):
    name: str
    """How overrides and logs refer to the key; also its tenant when ``tenant`` is unset."""
    sha256: str
    tenant: str | None = None
    """The tenant whose buckets the key spends (unset: the key's own name, so a listed key
    never shares a tenant with anonymous callers by accident)."""

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not re.match(r"^[0-9a-fA-F]{64}$", value):
            raise ValueError("sha256 must be 64 hex digits: the sha256 of the secret key")
        return value.lower()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        if value is not None and not is_tenant(value):
            raise ValueError(f"bad tenant {value!r}: use {TENANT_RULE}")
        return value

    @model_validator(mode="after")
    def _name_as_tenant(self) -> ApiKey:
        if self.tenant is None and not is_tenant(self.name):
            raise ValueError(f"api key {self.name!r} has no tenant, so its name is its tenant, "
                             f"and a tenant is {TENANT_RULE}: set tenant, or shorten the name")
        return self

    @property
    def effective_tenant(self) -> str:
        """The tenant the key's requests count against: ``tenant``, else ``name``."""
        return self.tenant if self.tenant is not None else self.name


class Limit(Strict):
    requests: str | None = None
    """Requests per window: 10/s, 600/min, 1k/h, 50/5m."""
    burst: int | None = Field(default=None, gt=0)
    """Capacity of the requests bucket (default: the rate's N)."""
    tokens: str | None = None
    """LLM tokens (prompt + completion) per window: 100k/min, 2M/h."""
    concurrent: int | None = Field(default=None, gt=0)
    """At most this many requests in flight (streams included); the next gets 429."""
    shadow: bool | None = None
    """Evaluate and count what this limit would deny, but never deny (default false)."""

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


class TelemetrySection(Strict):
    """Which chat/completions responses extproc reads (the rest only Envoy reads)."""

    sample: float = Field(default=0.01, ge=0, le=1)
    """Share of stable-variant chat/completions requests whose response body extproc reads for
    TTFT, time per output token, token counts and mid-stream errors, chosen from Envoy's request
    id. Canary traffic always is, and while a model has a canary as many of its stable requests
    as canary ones. 1: every request (as before; a 256-token stream then costs extproc ~15x a
    short answer); 0: only those and the responses Envoy cannot read usage from."""
    sample_min_per_s: int = Field(default=5, ge=0)
    """Besides that share, extproc reads up to this many of a model's other stable responses a
    second (per extproc worker process), so a quiet gateway measures every request; a busy one
    reads this many more a second than the share. 0: the share alone. These extra reads feed
    the metrics, not the canary guard (its stable side stays the share)."""
    envoy_usage: bool = True
    """true: for the other streamed requests Envoy's sse_to_metadata filter reads the usage for
    the rate limiter (and a Lua filter strips the usage chunk a client did not ask for; the
    bootstrap ``render`` writes has both), and no response body goes to extproc. Set false
    where Envoy runs another bootstrap (Istio's EnvoyFilter does not carry these filters):
    extproc then reads every response body, as before."""


class IstioSection(Strict):
    """What ``render`` writes to ``envoyfilter.yaml`` (an Istio EnvoyFilter)."""

    context: Literal["SIDECAR_INBOUND", "GATEWAY"] = "SIDECAR_INBOUND"
    """SIDECAR_INBOUND: the filters run in the sidecar of the selected workload, for traffic it
    receives; GATEWAY: in an Istio ingress gateway, before its VirtualService routing."""
    namespace: str | None = None
    """metadata.namespace of the EnvoyFilter (istio-system for the default ingress gateway);
    unset: the namespace it is applied in."""
    workload_selector: dict[str, str] | None = None
    """Labels of the pods whose proxies get the filters (default: app: llm-gateway for
    SIDECAR_INBOUND, istio: ingressgateway for GATEWAY)."""
    port: int | None = Field(default=None, gt=0, lt=65536)
    """Patch only the listener of this port (the workload's service port, or the gateway
    server port); unset: every HTTP listener of the context."""

    @property
    def selector(self) -> dict[str, str]:
        if self.workload_selector is not None:
            return self.workload_selector
        if self.context == "GATEWAY":
            return {"istio": "ingressgateway"}
        return {"app": "llm-gateway"}


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
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    istio: IstioSection = Field(default_factory=IstioSection)

    @field_validator("clusters", "models")
    @classmethod
    def _names(cls, value: dict[str, object]) -> dict[str, object]:
        for name in value:
            _check_name(str(name))
        return value
