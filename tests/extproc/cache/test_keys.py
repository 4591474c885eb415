"""Cache keys: what shares a vector and what must not, and the canary namespace rule."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.cache.keys import KEY_PREFIX, namespace_for, plan_keys, request_salt
from routing.compiled import CachePolicy


def key(item: str | tuple[int, ...], namespace: str = "ns", dimensions: int | None = None,
        encoding: str = "float", **options: Any) -> str:
    doc = {"model": "m", "input": item, **options}
    return plan_keys(namespace, request_salt(dimensions, encoding, doc), (item,)).keys[0]


def test_key_format() -> None:
    made = key("hello", namespace="bge-m3")
    prefix, digest = made.rsplit(":", 1)
    assert prefix == f"{KEY_PREFIX}bge-m3" == "llm-sidecar:emb:v1:bge-m3"
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert made == key("hello", namespace="bge-m3")  # stable across calls and processes


@pytest.mark.parametrize(("a", "b"), [
    ({"item": "hello"}, {"item": "hello "}),
    ({"item": "1,2"}, {"item": (1, 2)}),  # text vs token ids
    ({"item": (1, 2)}, {"item": (12,)}),
    ({"item": "x"}, {"item": "x", "namespace": "other"}),
    ({"item": "x"}, {"item": "x", "dimensions": 64}),
    ({"item": "x", "dimensions": 64}, {"item": "x", "dimensions": 32}),
    ({"item": "x"}, {"item": "x", "encoding": "base64"}),
    ({"item": "x"}, {"item": "x", "truncate_prompt_tokens": 8}),  # unknown options count
    ({"item": "x", "normalize": True}, {"item": "x", "normalize": False}),
])
def test_different_requests_get_different_keys(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key(**a) != key(**b)


def test_bookkeeping_fields_and_option_order_do_not_split_the_cache() -> None:
    base = key("x", truncate_prompt_tokens=8, normalize=True)
    assert key("x", normalize=True, truncate_prompt_tokens=8) == base
    assert key("x", truncate_prompt_tokens=8, normalize=True, user="alice") == base
    assert key("x", truncate_prompt_tokens=8, normalize=True, priority=2) == base


def test_model_is_not_in_the_key_the_namespace_is() -> None:
    salt_a = request_salt(None, "float", {"model": "bge-m3", "input": "x"})
    salt_b = request_salt(None, "float", {"model": "bge-m3-copy", "input": ["x"]})
    assert plan_keys("shared", salt_a, ("x",)) == plan_keys("shared", salt_b, ("x",))


def test_plan_dedupes_in_first_seen_order() -> None:
    plan = plan_keys("ns", request_salt(None, "float", {}), ("b", "a", "b", "c", "a"))
    assert len(plan.keys) == 5 and len(plan.distinct) == 3
    assert plan.keys[0] == plan.keys[2] and plan.keys[1] == plan.keys[4]
    assert plan.distinct == (plan.keys[0], plan.keys[1], plan.keys[3])
    assert [plan.items[k] for k in plan.distinct] == ["b", "a", "c"]


@pytest.mark.parametrize(("share", "variant", "expected"), [
    (False, "stable", "bge"),
    (False, "canary", "bge@bge-v2"),
    (True, "stable", "bge"),
    (True, "canary", "bge"),
])
def test_canary_reads_its_own_namespace_unless_shared(share: bool, variant: str,
                                                      expected: str) -> None:
    policy = CachePolicy("bge", 60, share_with_canary=share)
    upstream = "bge-v2" if variant == "canary" else "bge-m3"
    assert namespace_for(policy, variant, upstream) == expected


@pytest.mark.parametrize(("scope", "variant", "tenant", "expected"), [
    ("shared", "stable", "legal", "bge"),
    ("shared", "stable", "sales", "bge"),
    ("tenant", "stable", "legal", "bge#legal"),
    ("tenant", "stable", "sales", "bge#sales"),
    ("tenant", "canary", "legal", "bge@bge-v2#legal"),
])
def test_tenant_scope_gives_each_tenant_its_own_namespace(scope: str, variant: str, tenant: str,
                                                          expected: str) -> None:
    policy = CachePolicy("bge", 60, scope=scope)
    upstream = "bge-v2" if variant == "canary" else "bge-m3"
    assert namespace_for(policy, variant, upstream, tenant) == expected
