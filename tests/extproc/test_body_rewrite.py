"""The request body extproc sends on to vLLM: unchanged unless the canary renames the model,
``priority.inject`` adds vLLM's ``priority``, an unread stream gets ``include_usage`` added, a
model whose prefix cache is per tenant gets the tenant's ``cache_salt``, or a
request a token bucket charges gets the output budget it reserved for
(``GenerationProcessor.on_request_body``). Every rewrite keeps the client's other fields and
sets a ``content-length`` that matches the new body."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.actions import Action, Continue, Reply
from extproc.stream import StreamState
from sidecar_runtime.wire.names import (
    CAP_METADATA_KEY,
    ENVOY_USAGE_HEADER,
    RESERVATION_METADATA_KEY,
)
from tests.extproc.helpers import JSON_POST, snapshot

SECRET = b"test-secret"
CANARY: dict[str, dict[str, Any]] = {"llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "canary": {
    "model": "llama-2-13b-v2", "cluster": "vllm-canary", "percent": 100, "sticky": "request"}}}
NO_CANARY = {"llama-2-13b": {**CANARY["llama-2-13b"], "canary": {
    **CANARY["llama-2-13b"]["canary"], "percent": 0}}}
INJECT = {"high_below": 1, "low_from": 100, "inject": True}
"""A prompt of "hi" counts 17 tokens: 1 of text and the chat template's allowance of 16."""
UNREAD = {"rate_limits": {"tenant": {"default": {"tokens": "1M/h"}}},
          "telemetry": {"sample": 0, "envoy_usage": True}}
TOKENS = {"rate_limits": {"tenant": {"default": {"tokens": "1M/h"}}}}
"""A token bucket charges every request: one that sets no budget gets ``default_max_tokens``."""
EXTRA = {"temperature": 0.5, "user": "u-1", "logit_bias": {"42": -100}}
"""Fields the rewrite must pass on untouched."""


def routed(doc: dict[str, Any], **sections: Any) -> Continue:
    state = StreamState(snapshot(**sections), SECRET)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     ENVOY_USAGE_HEADER: "1"}, b"", False)
    action = state.handle("request_body", None, orjson.dumps(
        {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], **EXTRA, **doc}),
        True)
    assert isinstance(action, Continue)
    return action


def sent(action: Continue) -> dict[str, Any] | None:
    """The body as vLLM gets it; None when extproc leaves the client's bytes alone."""
    if action.body is None:
        assert "content-length" not in dict(action.set_headers)
        return None
    assert dict(action.set_headers)["content-length"] == str(len(action.body))
    body: dict[str, Any] = orjson.loads(action.body)
    assert {k: body[k] for k in EXTRA} == EXTRA
    return body


def changes(body: dict[str, Any] | None, doc: dict[str, Any]) -> dict[str, Any] | None:
    """What the rewrite changed or added, against the client's body."""
    if body is None:
        return None
    original = {"model": "llama-2-13b", **doc}
    return {k: v for k, v in body.items() if k not in EXTRA and k != "messages"
            and original.get(k, "<absent>") != v}


@pytest.mark.parametrize(("doc", "sections", "changed"), [
    # Nothing to change: the client's bytes go on as they are.
    ({"max_tokens": 10}, {}, None),
    ({"max_tokens": 10}, {"models": NO_CANARY}, None),
    ({"stream": True}, {}, None),  # read by extproc (sample 1): no usage to add
    # The canary serves under its own name.
    ({"max_tokens": 10}, {"models": CANARY}, {"model": "llama-2-13b-v2"}),
    # vLLM's priority, by tier (weight 17 x max_tokens / 1000): 0 high, 1 medium, 2 low.
    ({"max_tokens": 1}, {"priority": INJECT}, {"priority": 0}),
    ({"max_tokens": 100}, {"priority": INJECT}, {"priority": 1}),
    ({"max_tokens": 6000}, {"priority": INJECT}, {"priority": 2}),
    # No budget: its tier assumed default_max_tokens (256: weight 17 x 256 / 1000, medium), so
    # vLLM gets that budget with that priority, not the rest of the window at priority 0.
    ({}, {"priority": INJECT}, {"priority": 1, "max_tokens": 256}),
    # A client cannot buy a better place in vLLM's queue with its own field.
    ({"max_tokens": 6000, "priority": -100}, {"priority": INJECT}, {"priority": 2}),
    ({"max_tokens": 6000, "priority": "0"}, {"priority": INJECT}, {"priority": 2}),
    # An unread stream gets the usage chunk Envoy reads (and strips again).
    ({"stream": True, "max_tokens": 9}, UNREAD, {"stream_options": {"include_usage": True}}),
    ({"stream": True, "max_tokens": 9, "stream_options": {"include_usage": False}}, UNREAD,
     {"stream_options": {"include_usage": True}}),
    ({"stream": True, "max_tokens": 9, "stream_options": {"include_usage": True}}, UNREAD,
     None),  # asked itself
    # Charged by a token bucket and no budget of its own: vLLM would give it the rest of the
    # context window, so it gets the one its reservation assumed.
    ({}, TOKENS, {"max_tokens": 256}),
    ({"max_tokens": None}, TOKENS, {"max_tokens": 256}),
    ({"max_completion_tokens": 0}, TOKENS, {"max_tokens": 256}),  # vLLM: 0 or None
    ({"max_completion_tokens": None, "max_tokens": None}, TOKENS, {"max_tokens": 256}),
    ({"stream": True}, UNREAD, {"stream_options": {"include_usage": True}, "max_tokens": 256}),
    # vLLM's min_tokens above the default: the budget (and the reservation) is that minimum.
    ({"min_tokens": 400}, TOKENS, {"max_tokens": 400}),
    ({"min_tokens": 100}, TOKENS, {"max_tokens": 256}),
    ({"min_tokens": 400, "max_tokens": 500}, TOKENS, None),
    # Its own budget, or vLLM's 400 for a 0, is left as the client sent it.
    ({"max_tokens": 40}, TOKENS, None),
    ({"max_completion_tokens": 40}, TOKENS, None),
    ({"max_completion_tokens": 40, "max_tokens": None}, TOKENS, None),
    ({"max_tokens": 0}, TOKENS, None),
    # No token bucket charges it: vLLM decides the length, as without the gateway.
    ({}, {}, None),
    ({}, {"rate_limits": {"tenant": {"default": {"requests": "5/s"}}}}, None),
    ({}, {"rate_limits": {"tenant": {"default": {"tokens": "1M/h", "shadow": True}}}}, None),
    ({}, {"rate_limits": {"tenant": {"overrides": {"acme": {"tokens": "1M/h"}}}}}, None),
    # A stream extproc reads (the canary) is settled from its usage chunk too.
    ({"stream": True, "max_tokens": 9}, {**UNREAD, "models": CANARY},
     {"model": "llama-2-13b-v2", "stream_options": {"include_usage": True}}),
    # Per-chunk usage is asked for (include_usage defaults to true in vLLM): sent as it is.
    ({"stream": True, "max_tokens": 9, "stream_options": {"continuous_usage_stats": True}},
     UNREAD, None),
    # Without include_usage it is nothing to vLLM: only the flag is sent.
    ({"stream": True, "max_tokens": 9, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}},
     UNREAD, {"stream_options": {"include_usage": True}}),
    # All three at once.
    ({"stream": True, "max_tokens": 1}, {**UNREAD, "priority": INJECT, "models": CANARY},
     {"model": "llama-2-13b-v2", "priority": 0, "stream_options": {"include_usage": True}}),
])
def test_the_body_vllm_gets(doc: dict[str, Any], sections: dict[str, Any],
                            changed: dict[str, Any] | None) -> None:
    assert changes(sent(routed(doc, **sections)), doc) == changed


@pytest.mark.parametrize("value", [-100, 0, "0", None])
def test_without_injection_a_clients_priority_is_dropped(value: object) -> None:
    """vLLM with ``--scheduling-policy priority`` serves a lower ``priority`` first: a client's
    own value would buy a place in its queue even when the gateway does not set one."""
    body = sent(routed({"max_tokens": 10, "priority": value}))
    assert body is not None and "priority" not in body
    assert body["model"] == "llama-2-13b"


@pytest.mark.parametrize(("doc", "changed"), [
    ({"prompt": "hi"}, None),  # vLLM's own default for completions is 16 tokens
    ({"prompt": "hi", "max_tokens": None}, {"max_tokens": 256}),  # null: the rest of the window
    ({"prompt": "hi", "max_tokens": 40}, None),
    # Completions has no max_completion_tokens: vLLM ignores it, and so does the rewrite.
    ({"prompt": "hi", "max_tokens": None, "max_completion_tokens": 5}, {"max_tokens": 256}),
])
def test_a_completion_gets_a_budget_only_where_vllm_would_give_it_the_window(
        doc: dict[str, Any], changed: dict[str, Any] | None) -> None:
    state = StreamState(snapshot(**TOKENS), SECRET)
    state.handle("request_headers", {":path": "/v1/completions", **JSON_POST}, b"", False)
    action = state.handle("request_body", None,
                          orjson.dumps({"model": "llama-2-13b", **doc}), True)
    assert isinstance(action, Continue)
    if changed is None:
        assert action.body is None
        return
    assert action.body is not None
    body = orjson.loads(action.body)
    assert {k: v for k, v in body.items() if doc.get(k, "<absent>") != v and k != "model"} \
        == changed


@pytest.mark.parametrize(("doc", "reserved"), [
    ({}, 17 + 256),
    ({"min_tokens": 400}, 17 + 400),      # what vLLM will at least generate
    ({"min_tokens": 400, "n": 2}, 17 + 800),
    ({"max_tokens": 30, "min_tokens": 10}, 17 + 30),
])
def test_the_reservation_is_the_budget_written_in(doc: dict[str, Any], reserved: int) -> None:
    action = routed(doc, **TOKENS)
    assert action.metadata[RESERVATION_METADATA_KEY] == reserved
    body = sent(action)
    budget = (body or {}).get("max_tokens", doc.get("max_tokens"))
    assert 17 + budget * doc.get("n", 1) == reserved


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 60_000}}
PICTURES = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE,
                                                      IMAGE]}], "max_tokens": 10}


@pytest.mark.parametrize(("media_tokens", "reserved", "pool"), [
    (None, 17 + 2 * 1024 + 10, "vllm-long"),         # the defaults: 1,024 an image
    ({"image": 576}, 17 + 2 * 576 + 10, "vllm-short"),
    ({"image": 0}, 17 + 10, "vllm-short"),             # an operator's choice: text only
])
def test_images_reserve_what_the_model_prices_them_at(media_tokens: dict[str, int] | None,
                                                      reserved: int, pool: str) -> None:
    """Two images' base64 is ~80,000 bytes of body but no prompt text: each counts as the
    model's ``media_tokens.image`` for the reservation and for the pool that fits it."""
    model = dict(NO_CANARY["llama-2-13b"])
    if media_tokens is not None:
        model["media_tokens"] = media_tokens
    action = routed(PICTURES, models={"llama-2-13b": model}, **TOKENS)
    assert action.metadata[RESERVATION_METADATA_KEY] == reserved
    assert dict(action.set_headers)["x-llm-cluster"] == pool


@pytest.mark.parametrize(("sections", "capped"), [
    ({"rate_limits": {"tenant": {"default": {"concurrent": 2}}}}, True),
    ({"rate_limits": {"tenant": {"overrides": {"acme": {"concurrent": 2}}}}}, False),
    (TOKENS, False),
])
def test_a_request_a_cap_applies_to_is_marked_for_envoys_slot(sections: dict[str, Any],
                                                              capped: bool) -> None:
    metadata = routed({"max_tokens": 5}, **sections).metadata
    assert (metadata.get(CAP_METADATA_KEY) == "1") is capped
    assert capped or CAP_METADATA_KEY not in metadata


SALTED = {"llama-2-13b": {**NO_CANARY["llama-2-13b"], "prefix_cache_scope": "tenant"}}
"""``prefix_cache_scope: tenant``: every request carries its tenant's vLLM ``cache_salt``."""


def salted_action(doc: dict[str, Any], tenant: str | None = None, path: str = "/v1/chat/completions",
                  **sections: Any) -> Action:
    """What extproc answers to ``doc`` from ``tenant`` (open mode: the tenant header; None:
    tenant ``default``)."""
    state = StreamState(snapshot(**sections), SECRET)
    headers = {":path": path, **JSON_POST}
    if tenant is not None:
        headers["x-tenant-id"] = tenant
    state.handle("request_headers", headers, b"", False)
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    action = state.handle("request_body", None, orjson.dumps(
        {"model": "llama-2-13b", **prompt, **EXTRA, **doc}), True)
    assert isinstance(action, Continue | Reply)  # no cache lookup, no rate check here
    return action


def salt_of(doc: dict[str, Any], tenant: str | None = None, **sections: Any) -> Any:
    """The ``cache_salt`` vLLM gets; None when extproc leaves the client's bytes alone."""
    action = salted_action(doc, tenant, **sections)
    assert isinstance(action, Continue)
    body = sent(action)
    return None if body is None else body.get("cache_salt", "<absent>")


def test_a_shared_prefix_cache_leaves_a_body_without_a_salt_alone() -> None:
    assert salt_of({"max_tokens": 5}) is None
    assert salt_of({"max_tokens": 5, "cache_salt": None}) is None


def test_each_tenant_gets_a_salt_of_its_own_the_same_every_time() -> None:
    default, acme, other = (salt_of({"max_tokens": 5}, t, models=SALTED)
                            for t in (None, "acme", "other"))
    assert len({default, acme, other}) == 3
    assert salt_of({"max_tokens": 5}, "acme", models=SALTED) == acme  # any replica, any time
    assert isinstance(acme, str) and len(acme) == 43  # 256 bits, base64url, as vLLM suggests


def test_a_clients_own_salt_splits_its_tenant_but_never_joins_another() -> None:
    acme = salt_of({"max_tokens": 5}, "acme", models=SALTED)
    mine = salt_of({"max_tokens": 5, "cache_salt": "mine"}, "acme", models=SALTED)
    assert mine not in (acme, None)
    assert salt_of({"max_tokens": 5, "cache_salt": "mine"}, "other", models=SALTED) != mine
    # Sending another tenant's salt as one's own does not reach its blocks.
    assert salt_of({"max_tokens": 5, "cache_salt": acme}, "other", models=SALTED) != acme
    assert salt_of({"max_tokens": 5, "cache_salt": None}, "acme", models=SALTED) == acme


def test_a_shared_model_never_passes_a_clients_salt_on_as_sent() -> None:
    """vLLM's block hash does not cover the model's name: a client sending a tenant's salt to
    a shared model on the same pool would join that tenant's blocks. Its salt is folded into
    one no tenant's can equal; the same client salt still shares blocks with itself."""
    acme = salt_of({"max_tokens": 5}, "acme", models=SALTED)
    forged = salt_of({"max_tokens": 5, "cache_salt": acme}, "other")
    assert forged not in (acme, None, "<absent>")
    assert salt_of({"max_tokens": 5, "cache_salt": acme}, "third") == forged
    assert salt_of({"max_tokens": 5, "cache_salt": "mine"}) not in (forged, "mine")


@pytest.mark.parametrize("models", [SALTED, NO_CANARY])
@pytest.mark.parametrize("bad", ["", 5, True, [], {"a": 1}])
def test_a_salt_vllm_would_refuse_is_its_400(bad: object, models: dict[str, Any]) -> None:
    reply = salted_action({"max_tokens": 5, "cache_salt": bad}, "acme", models=models)
    assert isinstance(reply, Reply) and reply.status == 400
    error = orjson.loads(reply.body)["error"]
    assert error["param"] == "cache_salt"
    assert error["message"] == "Parameter 'cache_salt' must be a non-empty string if provided."


def test_a_completion_and_the_canary_are_salted_too() -> None:
    acme = salt_of({"max_tokens": 5}, "acme", models=SALTED)
    completion = salted_action({"max_tokens": 5}, "acme", "/v1/completions", models=SALTED)
    assert isinstance(completion, Continue) and completion.body is not None
    assert orjson.loads(completion.body)["cache_salt"] == acme
    canary = {"llama-2-13b": {**CANARY["llama-2-13b"], "prefix_cache_scope": "tenant"}}
    action = salted_action({"max_tokens": 5}, "acme", models=canary)
    assert isinstance(action, Continue)
    body = sent(action)
    assert body is not None and body["model"] == "llama-2-13b-v2" and body["cache_salt"] == acme
