"""Who a caller is, and how it could try to be someone else (CONTRACT §3 Tenants)."""

from __future__ import annotations

import hashlib

import pytest

from extproc.errors import ClientError
from extproc.identity import ANONYMOUS, identify
from routing.compiled import Snapshot
from tests.extproc.helpers import snapshot

SECRET = b"test-secret"
LEGAL_KEY, SOLO_KEY = "sk-legal", "sk-solo"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


KEYS = [{"name": "legal-bot", "sha256": sha(LEGAL_KEY), "tenant": "legal"},
        {"name": "solo", "sha256": sha(SOLO_KEY)}]
OPEN = snapshot(api_keys=KEYS,
                rate_limits={"tenant": {"overrides": {"vip": {"requests": "1/s"}}}})


def tenant_of(snap: Snapshot, **headers: str) -> str:
    return identify(snap, {k.replace("_", "-"): v for k, v in headers.items()}, SECRET).tenant


def bearer(key: str) -> str:
    return f"Bearer {key}"


@pytest.mark.parametrize(("headers", "tenant"), [
    # Listed keys: the config decides; a tenant header they send is not read.
    ({"authorization": bearer(LEGAL_KEY)}, "legal"),
    ({"authorization": bearer(LEGAL_KEY), "x_tenant_id": "acme"}, "legal"),
    ({"authorization": bearer(LEGAL_KEY), "x_tenant_id": "bad tenant"}, "legal"),
    ({"authorization": bearer(SOLO_KEY)}, "solo"),  # no tenant: its own name, not default
    ({"x_api_key": SOLO_KEY, "x_tenant_id": "legal"}, "solo"),
    # Unlisted keys and anonymous callers name their tenant, unless it is a listed key's.
    ({"authorization": bearer("sk-random"), "x_tenant_id": "acme"}, "acme"),
    ({"x_tenant_id": "acme"}, "acme"),
    ({"authorization": bearer("sk-random"), "x_tenant_id": "legal"}, "default"),
    ({"authorization": bearer("sk-random"), "x_tenant_id": "solo"}, "default"),  # name-derived
    ({"x_tenant_id": "legal"}, "default"),
    ({"x_tenant_id": "Legal"}, "Legal"),  # another tenant: buckets and labels are exact-match
    ({"x_tenant_id": "vip"}, "vip"),  # an override alone does not make a tenant listed
    ({"authorization": bearer("sk-random")}, "default"),
    ({"x_tenant_id": ""}, "default"),
    ({"x_tenant_id": "  "}, "default"),
    ({"x_tenant_id": " acme "}, "acme"),
    ({"x_tenant_id": "t" * 64}, "t" * 64),
    ({"x_tenant_id": "a.b_c-D9"}, "a.b_c-D9"),
    ({"x_tenant_id": "-"}, "-"),
])
def test_tenant_table(headers: dict[str, str], tenant: str) -> None:
    assert tenant_of(OPEN, **headers) == tenant


@pytest.mark.parametrize("value", [
    "acmé",  # a Unicode letter (str.isalnum() says yes)
    "٣",  # an Arabic-Indic digit, also isalnum()
    "".join(chr(ord(c) + 0xFEE0) for c in "acme"),  # fullwidth: looks like "acme"
    "t" * 65,  # used to be cut to 64 characters: a collision with a real tenant of that prefix
    "legal" + "x" * 60,
    "acme,legal",  # a repeated header, joined
    "acme corp",
    "acme\r\nx-llm-tenant: legal",
    "acme/..",
    "acme\x00",
])
def test_a_bad_tenant_header_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(ClientError) as caught:
        tenant_of(OPEN, x_tenant_id=value)
    err = caught.value
    assert (err.status, err.code, err.type, err.param) == (
        400, "invalid_tenant", "invalid_request_error", "x-tenant-id")
    assert err.message == ("The x-tenant-id header must name a tenant: 1 to 64 ASCII letters, "
                           "digits, '.', '_' or '-'.")
    assert value not in err.message


def test_the_configured_tenant_header_is_the_one_read() -> None:
    snap = snapshot(api_keys=KEYS, auth={"tenant_header": "X-Org"})
    assert tenant_of(snap, x_org="acme", x_tenant_id="other") == "acme"
    assert tenant_of(snap, x_org="legal") == "default"
    with pytest.raises(ClientError) as caught:
        tenant_of(snap, x_org="é")
    assert caught.value.param == "x-org" and "x-org header" in caught.value.message


def test_required_auth_answers_401_before_reading_the_tenant_header() -> None:
    snap = snapshot(api_keys=KEYS, auth={"required": True})
    for headers in ({"x-tenant-id": "acme"}, {"x-tenant-id": "é"},
                    {"authorization": bearer("sk-random"), "x-tenant-id": "acme"}):
        with pytest.raises(ClientError) as caught:
            identify(snap, headers, SECRET)
        assert caught.value.status == 401
    assert tenant_of(snap, authorization=bearer(SOLO_KEY)) == "solo"


def test_key_ids_never_carry_the_key() -> None:
    listed = identify(OPEN, {"authorization": bearer(SOLO_KEY)}, SECRET)
    unlisted = identify(OPEN, {"authorization": bearer("sk-random")}, SECRET)
    anonymous = identify(OPEN, {}, SECRET)
    assert listed.key_id.startswith("k") and listed.key_name == "solo"
    assert unlisted.key_id.startswith("u") and unlisted.key_name is None
    assert anonymous.key_id == ANONYMOUS
    assert "sk-" not in listed.key_id + unlisted.key_id


def test_tenant_sets_of_the_snapshot() -> None:
    """Listed tenants include name-derived ones; metric labels know only configured tenants,
    so callers naming a million tenants still make a bounded label set."""
    assert OPEN.listed_tenants == {"legal", "solo"}
    assert OPEN.known_tenants == {"default", "legal", "solo"}
    assert {k.tenant for k in OPEN.keys_by_sha256.values()} == {"legal", "solo"}
