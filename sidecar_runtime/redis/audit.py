"""Say loudly when a service runs against a Redis that anyone on the network could use.

An unauthenticated Redis reached over the network is how rate-limit state gets abused: anyone
who can connect can refill their own buckets, drain a competitor's, or read cached vectors. So
a Redis URL without a password logs a warning at start-up (unless ``dev_mode``) and sets the
``llm_sidecar_redis_unauthenticated`` gauge (always: it states a fact an alert can watch).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Gauge
from pydantic import SecretStr

from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.redis.url import check_url

log = get_logger("llm_sidecar.redis")


@dataclass(frozen=True)
class RedisExposure:
    """What a Redis URL says about how the connection is protected."""

    password: bool
    tls: bool
    loopback: bool


def exposure(url: str) -> RedisExposure:
    """What ``url`` says; a password counts in either form redis-py reads (``:PASSWORD@`` or
    the ``?password=`` parameter)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    in_query = any(value for value in parse_qs(parts.query).get("password", []))
    return RedisExposure(
        password=bool(parts.password) or in_query,
        tls=parts.scheme.startswith("rediss"),
        loopback=host in ("localhost", "::1") or host.startswith("127."),
    )


def audit_redis(url: SecretStr | None, dev_mode: bool, registry: CollectorRegistry,
                service: str) -> RedisExposure | None:
    """Warn (outside dev mode) and set the gauge for the Redis ``url`` a service will use;
    :class:`~sidecar_runtime.redis.url.RedisUrlError` for a URL no request could use.

    Returns what was found, or None when no Redis is configured (in-process memory).
    """
    gauge = Gauge("llm_sidecar_redis_unauthenticated",
                  "1 when the configured Redis URL carries no password (anyone who can reach "
                  "that Redis can rewrite rate-limit buckets and cached vectors).",
                  registry=registry)
    if url is None:
        gauge.set(0)
        return None
    check_url(url.get_secret_value())  # first: a URL that does not parse is refused, not read
    found = exposure(url.get_secret_value())
    gauge.set(0 if found.password else 1)
    if not found.password and not dev_mode:
        log.warning(
            "redis_without_password", service=service, tls=found.tls,
            detail="the Redis URL has no password: anyone who can reach this Redis can rewrite "
                   "rate-limit buckets and cached vectors. Use rediss://:PASSWORD@host (or "
                   "USER:PASSWORD@ for an ACL user); LLM_SIDECAR_DEV_MODE=true silences this.")
    return found
