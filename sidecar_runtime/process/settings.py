"""Process settings: flags first, then ``LLM_SIDECAR_*`` environment variables.

Every service reads one :class:`Settings`; nothing else looks at the environment.
"""

from __future__ import annotations

import re

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRET_URL_PARAMETERS = frozenset({"password", "ssl_password"})
"""redis-py URL query parameters that carry a secret (``?password=`` is as good as
``:PASSWORD@`` to redis-py, and ``ssl_password`` unlocks the client's TLS key)."""
DEFAULT_KEY_ID_SECRET = "llm-sidecar-dev-key-id-secret"
PUBLIC_KEY_ID_SECRETS = frozenset({DEFAULT_KEY_ID_SECRET, "change-me"})
"""Secrets anyone can read in this repository: the default, and the compose file's fallback."""


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

    settle_batch_ms: float = Field(default=20.0, ge=0, le=60_000)
    """extproc settles the token reservations of responses it read itself (every non-streamed
    answer, sampled streams) in one rate-limit call per this many milliseconds, instead of
    one stream-done call per request from Envoy. 0: Envoy settles every request, as before."""

    settle_batch_min: int = Field(default=3, ge=1, le=256)
    """extproc starts a batch only when the last ``settle_batch_ms`` saw this many settlements
    (fewer: Envoy settles them, one call each, which is cheaper than a batch of one or two)."""

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

    grpc_max_connections: int = Field(default=1024, ge=1, le=1_000_000)
    """Open gRPC connections per process (a worker's own, with ``--workers``); one more is
    answered GOAWAY ``ENHANCE_YOUR_CALM`` and closed. Envoy opens a few per worker thread."""

    workers: int = 1
    """Processes of ``extproc``/``ratelimit`` serving their gRPC port together (the
    ``--workers`` flag wins): one core each (docs: Workers: one process per core)."""

    log_level: str = "info"
    dev_mode: bool = False
    """Quiets production-only warnings (for example a Redis without a password)."""

    key_id_secret: SecretStr = SecretStr(DEFAULT_KEY_ID_SECRET)
    """HMAC key that turns unlisted API keys into ids; set it in production (left at this
    public default, anyone can compute a key's id, and extproc warns at start-up)."""

    reload_interval_s: float = 0.5
    """How often the routing YAML is checked for changes."""

    worker_dir: str | None = None
    """The folder the workers of one ``--workers`` supervisor share (set by the supervisor for
    them): the copy of the last config file that loaded, the canary guards' verdicts (README,
    "Workers")."""




_SECRET_PARAMETER = re.compile(
    r"([?&](?:" + "|".join(sorted(SECRET_URL_PARAMETERS)) + r")=)[^&#]*", re.IGNORECASE)


def redis_url_for_logs(url: SecretStr | None) -> str:
    """The Redis URL with every credential masked, safe for logs: the password of
    ``USER:PASSWORD@`` or ``:PASSWORD@`` and the ``password``/``ssl_password`` parameters, in
    every scheme redis-py reads (``redis``, ``rediss``, ``unix``, and the cluster forms).

    Masks generously where a URL is ambiguous (``?``, ``@`` or ``:`` inside a password): two
    passes over the whole text, never a parse that a strange password could fool.
    """
    if url is None:
        return "memory"
    raw = url.get_secret_value()
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return "***"  # not a URL redis-py reads: show nothing rather than guess
    rest, hash_sep, _ = rest.partition("#")
    creds, at, location = rest.rpartition("@")
    if at:
        user, colon, _ = creds.partition(":")
        rest = f"{user}:***@{location}" if colon else f"{user}@{location}"
    masked = _SECRET_PARAMETER.sub(r"\1***", f"{scheme}://{rest}")
    return masked + ("#***" if hash_sep else "")
