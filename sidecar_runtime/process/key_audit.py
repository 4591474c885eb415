"""Say loudly when extproc hashes API keys with a public ``LLM_SIDECAR_KEY_ID_SECRET`` (the
default, or the ``change-me`` fallback of the compose file).

Unlisted keys become ids as HMAC(secret, sha256(key)). With the default secret, which is in
this repository, anyone holding a key can compute its id, and anyone holding an id can test
guessed keys against it offline: ids then hide nothing. So the default logs a warning at
start-up (unless ``dev_mode``) and sets the ``llm_sidecar_key_id_secret_default`` gauge
(always: it states a fact an alert can watch), as :mod:`sidecar_runtime.redis.audit` does for Redis.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from pydantic import SecretStr

from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.settings import PUBLIC_KEY_ID_SECRETS

log = get_logger("llm_sidecar.keys")


def audit_key_id_secret(secret: SecretStr, dev_mode: bool, registry: CollectorRegistry) -> bool:
    """Warn (outside dev mode) and set the gauge; True when the default secret is in use."""
    gauge = Gauge("llm_sidecar_key_id_secret_default",
                  "1 when API key ids are made with the public default LLM_SIDECAR_KEY_ID_SECRET "
                  "(anyone can then compute a key's id, or test guesses against an id).",
                  registry=registry)
    default = secret.get_secret_value() in PUBLIC_KEY_ID_SECRETS
    gauge.set(1 if default else 0)
    if default and not dev_mode:
        log.warning(
            "key_id_secret_default",
            detail="LLM_SIDECAR_KEY_ID_SECRET is the public default: API key ids in headers, "
                   "logs and Redis keys can be computed by anyone. Set a random secret, the "
                   "same on every extproc replica; LLM_SIDECAR_DEV_MODE=true silences this.")
    return default
