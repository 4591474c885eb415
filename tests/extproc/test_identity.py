"""Who a caller is, and how it could try to be someone else (docs: Identity, canaries and priority)."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest

from extproc import identity
from extproc.errors import ClientError
from extproc.identity import ANONYMOUS, Identity, identify, presented_key, unlisted_key_id
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


@pytest.mark.parametrize(("headers", "key"), [
    ({"authorization": "Bearer sk-a"}, "sk-a"),
    ({"authorization": "bearer sk-a"}, "sk-a"),  # HTTP auth schemes are case-insensitive
    ({"authorization": "BEARER sk-a"}, "sk-a"),
    ({"authorization": "  Bearer   sk-a  "}, "sk-a"),
    ({"x-api-key": "sk-b"}, "sk-b"),
    ({"x-api-key": "  sk-b "}, "sk-b"),
    ({"authorization": "Bearer sk-a", "x-api-key": "sk-b"}, "sk-a"),  # Authorization wins
    ({"authorization": "Basic c2stYQ==", "x-api-key": "sk-b"}, "sk-b"),  # not a bearer token
    ({"authorization": "Bearer ", "x-api-key": "sk-b"}, "sk-b"),
    ({"authorization": "Basic c2stYQ=="}, None),
    ({"authorization": "Token sk-a"}, None),
    ({"authorization": "Bearer"}, None),
    ({"authorization": "Bearer    "}, None),
    ({"authorization": "sk-a"}, None),  # a bare key is not a bearer token
    ({"x-api-key": ""}, None),
    ({"x-api-key": "   "}, None),
    ({}, None),
])
def test_the_presented_key(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(headers) == key


@pytest.mark.parametrize("headers", [
    {"authorization": bearer(SOLO_KEY)}, {"authorization": f"bearer  {SOLO_KEY} "},
    {"x-api-key": SOLO_KEY}, {"x-api-key": f" {SOLO_KEY}"}])
def test_a_listed_key_is_the_same_caller_however_it_is_sent(headers: dict[str, str]) -> None:
    assert identify(OPEN, headers, SECRET) == Identity(
        OPEN.keys_by_sha256[sha(SOLO_KEY)].key_id, "solo", "solo")


def test_a_near_miss_of_a_listed_key_is_an_unlisted_caller() -> None:
    for near in (SOLO_KEY.upper(), SOLO_KEY + "x", SOLO_KEY[:-1], f"{SOLO_KEY}\x00"):
        caller = identify(OPEN, {"authorization": bearer(near)}, SECRET)
        assert caller.key_name is None and caller.key_id.startswith("u") and caller.tenant == "default"


def test_unlisted_key_ids_are_a_keyed_hash_of_the_key() -> None:
    """Stable across replicas sharing the secret, different under another secret (ids in
    logs and metrics from two deployments cannot be joined), and not the key's plain sha256
    (which anyone holding a leaked key could compute and look for)."""
    digest = sha("sk-random")
    key_id = unlisted_key_id(SECRET, digest)
    assert key_id == "u" + hmac.new(SECRET, digest.encode(), hashlib.sha256).hexdigest()[:20]
    assert identify(OPEN, {"x-api-key": "sk-random"}, SECRET).key_id == key_id
    assert unlisted_key_id(SECRET, digest) == key_id
    assert unlisted_key_id(b"another-secret", digest) != key_id
    assert unlisted_key_id(SECRET, sha("sk-random2")) != key_id
    assert key_id[1:] not in digest
    assert re.fullmatch(r"u[0-9a-f]{20}", key_id)


def test_listed_and_unlisted_ids_cannot_collide() -> None:
    """A listed id starts with "k", an unlisted one with "u", the anonymous id is a word: no
    unlisted caller can share a listed key's per-key bucket or metric label."""
    listed = {k.key_id for k in OPEN.keys_by_sha256.values()}
    assert all(re.fullmatch(r"k[0-9a-f]{20}", key_id) for key_id in listed)
    unlisted = {identify(OPEN, {"x-api-key": f"sk-{i}"}, SECRET).key_id for i in range(200)}
    assert len(unlisted) == 200 and not unlisted & listed and ANONYMOUS not in unlisted


def test_remembered_key_ids_are_the_keyed_hash_and_stay_bounded() -> None:
    """The ids kept for unlisted keys are the ones computed fresh (first use, again, under
    another secret), and a client sending endless made-up keys cannot grow the memory."""
    def fresh(secret: bytes, digest: str) -> str:
        return "u" + hmac.new(secret, digest.encode(), hashlib.sha256).hexdigest()[:20]

    digests = [sha(f"sk-made-up-{i}") for i in range(identity._KEY_IDS + 10)]
    for digest in digests:
        assert unlisted_key_id(SECRET, digest) == fresh(SECRET, digest)
        assert len(identity._key_ids) <= identity._KEY_IDS
    for digest in (digests[0], digests[-1]):
        assert unlisted_key_id(SECRET, digest) == fresh(SECRET, digest)
        assert unlisted_key_id(b"another-secret", digest) == fresh(b"another-secret", digest)
