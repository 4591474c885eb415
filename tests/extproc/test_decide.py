from __future__ import annotations

import pytest

from extproc.decide import (
    Demand,
    canary_bucket,
    context_length,
    decide,
    on_canary,
    parse_context_hint,
    priority_tier,
    reservation,
)
from extproc.errors import ClientError
from routing.compiled import Canary
from tests.extproc.helpers import snapshot

SNAP = snapshot()
LLAMA = SNAP.models["llama-2-13b"]


@pytest.mark.parametrize(("prompt", "output", "hint", "expected"), [
    (100, 10, 0, 110), (100, 10, 2048, 2048), (5000, 1, 10, 5001), (0, 0, 0, 0),
])
def test_context_length_is_the_larger_of_hint_and_count(prompt: int, output: int, hint: int,
                                                        expected: int) -> None:
    assert context_length(prompt, output, hint) == expected


@pytest.mark.parametrize(("hint", "cluster"), [
    (1, "vllm-short"), (2048, "vllm-short"), (2049, "vllm-long"), (32768, "vllm-long"),
])
def test_pools_by_hint(hint: int, cluster: str) -> None:
    assert decide(LLAMA, Demand((10,), 1), hint, "k", 500, 5000).cluster == cluster


def test_above_every_pool_is_413() -> None:
    with pytest.raises(ClientError) as caught:
        decide(LLAMA, Demand((10,), 1), 32769, "k", 500, 5000)
    assert (caught.value.status, caught.value.code) == (413, "context_length_exceeded")
    # The header asked for it, not the prompt: the error says so (and names it as the param).
    assert caught.value.param == "X-Context-Length"
    assert "X-Context-Length header asks for 32769 tokens" in caught.value.message
    with pytest.raises(ClientError) as counted:
        decide(LLAMA, Demand((32760,), 10), 0, "k", 500, 5000)
    assert counted.value.param == "messages"
    assert "you requested 32770 tokens (32760 in the prompt, 10 for" in counted.value.message


def test_default_max_tokens_counts_when_unset() -> None:
    assert decide(LLAMA, Demand((1800,), None), 0, "k", 500, 5000).cluster == "vllm-long"
    assert decide(LLAMA, Demand((1800,), 10), 0, "k", 500, 5000).cluster == "vllm-short"


@pytest.mark.parametrize(("value", "expected"), [(None, 0), ("", 0), ("2048", 2048), (" 7 ", 7)])
def test_hint_parsing(value: str | None, expected: int) -> None:
    assert parse_context_hint(value) == expected


@pytest.mark.parametrize("value", ["-1", "abc", "1e3", "9" * 13, "1.5"])
def test_bad_hints_are_400(value: str) -> None:
    with pytest.raises(ClientError) as caught:
        parse_context_hint(value)
    assert caught.value.status == 400


@pytest.mark.parametrize(("prompt", "output", "tier"), [
    (10, 10, "high"), (1000, 499, "high"), (1000, 500, "medium"), (1000, 4999, "medium"),
    (1000, 5000, "low"), (32000, 256, "low"),
])
def test_priority_tiers(prompt: int, output: int, tier: str) -> None:
    assert priority_tier(prompt, output, 500, 5000) == tier


def test_canary_is_sticky_and_monotonic_in_percent() -> None:
    five = Canary("v2", "vllm-canary", 5, "api_key", 32768)
    ten = Canary("v2", "vllm-canary", 10, "api_key", 32768)
    keys = [f"key-{i}" for i in range(4000)]
    on5 = {k for k in keys if on_canary(five, k, "m")}
    on10 = {k for k in keys if on_canary(ten, k, "m")}
    assert on5 <= on10
    assert 0.038 <= len(on5) / len(keys) <= 0.062
    assert all(canary_bucket(k, "m") == canary_bucket(k, "m") for k in keys[:50])


# default_max_tokens of LLAMA is 256.
@pytest.mark.parametrize(("demand", "expected"), [
    (Demand((100,), 10), 110),
    (Demand((100,), None), 356),  # no budget set: the model's default
    (Demand((0,), None), 256),
    (Demand((100,), 10, choices=4), 140),  # n: the prompt once, the output per choice
    (Demand((100, 50, 7), 10), 157 + 30),  # a batch: every prompt, output for each
    (Demand((100, 50, 7), 10, choices=3), 157 + 90),
    (Demand((100, 50), None, choices=2), 150 + 256 * 2 * 2),
    (Demand((1,) * 2048, 1, choices=128), 2048 + 2048 * 128),
    (Demand((5,), 0), 5),  # an explicit 0 is "no output" (embeddings); parsing maps <= 0 to None
    # vLLM's min_tokens: the output assumed without a budget is at least that.
    (Demand((100,), None, min_output_tokens=400), 500),
    (Demand((100,), None, min_output_tokens=100), 356),
    (Demand((100,), 30, min_output_tokens=400), 130),  # with a budget (vLLM's 400 follows)
])
def test_reservation_table(demand: Demand, expected: int) -> None:
    assert reservation(demand, LLAMA.default_max_tokens) == expected
    assert decide(LLAMA, demand, 0, "k", 500, 5000).reservation == expected


@pytest.mark.parametrize(("demand", "length", "cluster"), [
    (Demand((1000,), 1000), 2000, "vllm-short"),
    (Demand((1000,), 1000, choices=128), 2000, "vllm-short"),  # each choice is its own context
    (Demand((1000, 1040, 10), 1000), 2040, "vllm-short"),  # the longest prompt decides
    (Demand((1000, 1049), 1000), 2049, "vllm-long"),
])
def test_context_is_the_longest_prompt_plus_one_sequence(demand: Demand, length: int,
                                                         cluster: str) -> None:
    decision = decide(LLAMA, demand, 0, "k", 500, 5000)
    assert (decision.context_length, decision.cluster) == (length, cluster)


# Tiers: high below 100, low from 200.
@pytest.mark.parametrize(("demand", "tier"), [
    (Demand((1000,), 50), "high"),  # 1000 x 50 / 1000 = 50
    (Demand((1000,), 50, choices=3), "medium"),  # n multiplies the output: 150
    (Demand((1000,), 50, choices=4), "low"),  # 200
    (Demand((1000, 1000, 1000), 50), "medium"),  # so do the prompts of a batch: 150
    (Demand((1000, 10, 10, 10), 50), "low"),  # the longest prompt x all output: 200
    (Demand((10,), None), "high"),  # the default budget: 10 x 256 / 1000
    (Demand((1000,), None), "low"),  # 256
])
def test_choices_and_prompts_weigh_in_priority(demand: Demand, tier: str) -> None:
    assert decide(LLAMA, demand, 0, "k", 100, 200).priority == tier
