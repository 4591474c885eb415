"""Which requests get an output budget written in (:mod:`extproc.output_budget`): those an
enforcing token limit charges, at any level, through the level's override for their value or
its default."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from extproc.hit_limits import limit_applies
from extproc.output_budget import budget_unset, charged_for_tokens, upstream_max_tokens
from routing.compiled import listed_key_id
from tests.extproc.helpers import snapshot

BOT_SHA = hashlib.sha256(b"sk-bot").hexdigest()
BOT_ID = listed_key_id(BOT_SHA)
KEYS = {"api_keys": [{"name": "bot", "sha256": BOT_SHA, "tenant": "acme"}]}


def values(key: str = "k-anon", tenant: str = "default", model: str = "llama-2-13b") -> dict[str, str]:
    """The routing headers Envoy's descriptors read each level's value from."""
    return {"x-llm-key-id": key, "x-llm-tenant": tenant, "x-llm-model": model,
            "x-llm-cluster": "vllm-short"}


@pytest.mark.parametrize(("limits", "request_values", "charged"), [
    (None, values(), False),
    ({"tenant": {"default": {"requests": "5/s"}}}, values(), False),
    ({"tenant": {"default": {"concurrent": 3}}}, values(), False),
    ({"tenant": {"default": {"tokens": "1M/h"}}}, values(), True),
    ({"tenant": {"default": {"tokens": "1M/h", "shadow": True}}}, values(), False),
    # An override applies to its value only; it inherits the default's token rate.
    ({"tenant": {"overrides": {"acme": {"tokens": "1M/h"}}}}, values(), False),
    ({"tenant": {"overrides": {"acme": {"tokens": "1M/h"}}}}, values(tenant="acme"), True),
    ({"tenant": {"default": {"tokens": "1M/h"}, "overrides": {"acme": {"requests": "9/s"}}}},
     values(tenant="acme"), True),
    # A shadow override switches the default off for its value only.
    ({"tenant": {"default": {"tokens": "1M/h"}, "overrides": {"acme": {"shadow": True}}}},
     values(tenant="acme"), False),
    ({"tenant": {"default": {"tokens": "1M/h"}, "overrides": {"acme": {"shadow": True}}}},
     values(tenant="other"), True),
    # Any level charges: a model's own bucket, or a listed key's (named by its key id).
    ({"model": {"overrides": {"llama-2-13b": {"tokens": "500k/min"}}}}, values(), True),
    ({"model": {"overrides": {"llama-2-13b": {"tokens": "500k/min"}}}},
     values(model="other-model"), False),
    ({"api_key": {"overrides": {"bot": {"tokens": "10k/min"}}}}, values(key=BOT_ID), True),
    ({"api_key": {"overrides": {"bot": {"tokens": "10k/min"}}}}, values(), False),
    ({"api_key": {"default": {"tokens": "10k/min"}}}, values(), True),
    ({"api_key": {"default": {"tokens": "1k/min", "shadow": True}},
      "tenant": {"overrides": {"acme": {"tokens": "1M/h"}}}}, values(tenant="acme"), True),
])
def test_which_requests_a_token_bucket_charges(limits: dict[str, Any] | None,
                                               request_values: dict[str, str],
                                               charged: bool) -> None:
    sections: dict[str, Any] = {**KEYS}
    if limits is not None:
        sections["rate_limits"] = limits
    assert charged_for_tokens(snapshot(**sections).config, request_values) is charged


@pytest.mark.parametrize(("api", "doc", "unset"), [
    ("chat", {}, True),
    ("chat", {"max_tokens": None}, True),
    ("chat", {"max_completion_tokens": 0}, True),           # vLLM: 0 or None is None
    ("chat", {"max_completion_tokens": 0, "max_tokens": 7}, False),
    ("chat", {"max_completion_tokens": 7, "max_tokens": None}, False),
    ("chat", {"max_tokens": 0}, False),                     # None or 0 is 0: vLLM's 400
    ("chat", {"max_tokens": 12}, False),
    ("completions", {}, False),                             # vLLM's default: 16
    ("completions", {"max_tokens": None}, True),
    ("completions", {"max_completion_tokens": 7, "max_tokens": None}, True),
    ("completions", {"max_tokens": 3}, False),
])
def test_when_vllm_would_choose_the_length_itself(api: Any, doc: dict[str, Any],
                                                  unset: bool) -> None:
    assert budget_unset(api, doc) is unset


@pytest.mark.parametrize(("budget", "unset"), [(16, False), (256, False), (15, True), (1, True)])
def test_an_absent_completions_budget_is_vllms_16(budget: int, unset: bool) -> None:
    """vLLM gives a completion without max_tokens 16 tokens: more than a default below 16
    reserves, so such a default is written."""
    assert budget_unset("completions", {}, budget) is unset
    assert budget_unset("completions", {"max_tokens": 3}, budget) is False
    config = snapshot(rate_limits={"tenant": {"default": {"tokens": "1M/h"}}}).config
    assert upstream_max_tokens(config, "completions", {}, budget, values()) \
        == (budget if unset else None)


def test_a_zero_default_writes_nothing() -> None:
    """``default_max_tokens: 0`` reserves the prompt only; writing 0 would be vLLM's 400."""
    config = snapshot(rate_limits={"tenant": {"default": {"tokens": "1M/h"}}}).config
    assert upstream_max_tokens(config, "chat", {}, 0, values()) is None
    assert upstream_max_tokens(config, "chat", {}, 64, values()) == 64


@pytest.mark.parametrize(("limits", "request_values", "capped"), [
    (None, values(), False),
    ({"tenant": {"default": {"tokens": "1M/h"}}}, values(), False),
    ({"tenant": {"default": {"concurrent": 3}}}, values(), True),
    ({"tenant": {"default": {"concurrent": 3, "shadow": True}}}, values(), True),  # counted too
    ({"tenant": {"overrides": {"acme": {"concurrent": 3}}}}, values(), False),
    ({"tenant": {"overrides": {"acme": {"concurrent": 3}}}}, values(tenant="acme"), True),
    ({"api_key": {"overrides": {"bot": {"concurrent": 1}}}}, values(key=BOT_ID), True),
    ({"model": {"overrides": {"llama-2-13b": {"concurrent": 9}}}}, values(), True),
])
def test_which_requests_take_a_concurrency_slot(limits: dict[str, Any] | None,
                                               request_values: dict[str, str],
                                               capped: bool) -> None:
    """extproc marks them (``llm_cap``): the bootstrap's concurrency actions need the mark, so
    no other request takes a slot or makes the stream-done call that frees one."""
    sections: dict[str, Any] = {**KEYS}
    if limits is not None:
        sections["rate_limits"] = limits
    config = snapshot(**sections).config
    assert limit_applies(config, request_values, "concurrent", enforcing=False) is capped
