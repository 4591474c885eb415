"""Credentials in a Redis URL never reach a log line, in any form redis-py accepts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from sidecar_runtime.process.key_audit import audit_key_id_secret
from sidecar_runtime.process.settings import DEFAULT_KEY_ID_SECRET, redis_url_for_logs

SECRET = "S3cr3t"


@pytest.mark.parametrize(("url", "logged"), [
    (None, "memory"),
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://app:{SECRET}@h:6380/0", "rediss://app:***@h:6380/0"),
    ("redis://app@h/0", "redis://app@h/0"),  # a user name alone is no secret
    (f"redis://h:6379/0?password={SECRET}&db=1", "redis://h:6379/0?password=***&db=1"),
    (f"redis://h/0?db=1&password={SECRET}", "redis://h/0?db=1&password=***"),
    (f"rediss://h/0?ssl_ca_certs=/ca.pem&ssl_password={SECRET}",
     "rediss://h/0?ssl_ca_certs=/ca.pem&ssl_password=***"),
    (f"unix:///run/redis.sock?password={SECRET}&db=0", "unix:///run/redis.sock?password=***&db=0"),
    (f"redis+cluster://:{SECRET}@h:7000", "redis+cluster://:***@h:7000"),
    (f"rediss+cluster://h:7000?password={SECRET}", "rediss+cluster://h:7000?password=***"),
    # Passwords with the URL's own delimiters in them: masked generously, never shown.
    (f"redis://:{SECRET}?x@h/0", "redis://:***@h/0"),
    (f"redis://:{SECRET}@x@h/0", "redis://:***@h/0"),
    (f"redis://h/0?password={SECRET}@x:y", "redis://h/0?password=***"),
    (f"redis://h/0#{SECRET}", "redis://h/0#***"),
    (f"not a url {SECRET}", "***"),
])
def test_redis_url_for_logs_masks_every_credential(url: str | None, logged: str) -> None:
    masked = redis_url_for_logs(SecretStr(url) if url is not None else None)
    assert masked == logged
    assert SECRET not in masked


@pytest.mark.parametrize(("secret", "public"), [
    (DEFAULT_KEY_ID_SECRET, True), ("change-me", True), ("9f2c0a-random", False)])
def test_a_public_key_id_secret_sets_the_gauge(secret: str, public: bool) -> None:
    registry = CollectorRegistry()
    assert audit_key_id_secret(SecretStr(secret), True, registry) is public
    assert registry.get_sample_value("llm_sidecar_key_id_secret_default") == (1 if public else 0)
