"""Process settings: flags first, then ``LLM_SIDECAR_*`` environment variables.

Every service reads one :class:`Settings`; nothing else looks at the environment.
"""

from __future__ import annotations

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """What an operator can set per process (the routing YAML says what the gateway does)."""

    model_config = SettingsConfigDict(env_prefix="LLM_SIDECAR_", extra="ignore")

    redis_url: SecretStr | None = None
    """``redis://``, ``rediss://`` or ``redis+cluster://`` URL; unset means in-process memory."""

    redis_timeout_ms: int = 50
    """Deadline for one Redis decision (rate limit or cache lookup), in milliseconds."""

    redis_breaker_cooldown_ms: int = 1000
    """After Redis failed (see ``redis_breaker_failures``), how long to skip it before trying
    it again."""

    redis_breaker_failures: int = 3
    """Consecutive Redis failures that open the breaker. One missed deadline can be this
    process's own CPU starvation rather than Redis; a frozen Redis misses them all."""

    cache_store_timeout_ms: int = 1000
    """Deadline for storing embedding vectors (after the answer is sent, so it may be longer)."""

    cache_memory_bytes: int = 256 * 1024 * 1024
    """Bound of the in-process embedding cache used when no Redis URL is set (LRU)."""

    grpc_tls_cert_file: str | None = None
    """Serve extproc's and ratelimit's gRPC over TLS with this certificate (PEM chain)..."""
    grpc_tls_key_file: str | None = None
    """...and this private key (PEM). Envoy's side is ``services.tls`` in the routing YAML."""
    grpc_tls_client_ca_file: str | None = None
    """Also require a client certificate signed by this CA (mutual TLS with Envoy)."""

    shutdown_grace_s: float = 30.0
    """On SIGTERM: how long requests in flight may take to finish (an SSE stream holds its
    ext_proc stream until the last token). Keep Kubernetes' terminationGracePeriodSeconds above
    it."""

    log_level: str = "info"
    dev_mode: bool = False
    """Quiets production-only warnings (for example a Redis without a password)."""

    key_id_secret: SecretStr = SecretStr("llm-sidecar-dev-key-id-secret")
    """HMAC key that turns unlisted API keys into ids; set it in production."""

    reload_interval_s: float = 0.5
    """How often the routing YAML is checked for changes."""


def redis_url_for_logs(url: SecretStr | None) -> str:
    """The Redis URL with any password masked, safe for logs."""
    if url is None:
        return "memory"
    raw = url.get_secret_value()
    scheme, sep, rest = raw.partition("://")
    if not sep or "@" not in rest:
        return raw
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"
