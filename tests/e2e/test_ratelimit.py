"""Rate limits through real Envoy: per key, tenant and model; requests and LLM tokens."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body

BOT_KEY = "sk-contract-bot-secret"


def doc() -> dict[str, Any]:
    d = default_doc()
    d["api_keys"] = [{"name": "contract-bot", "sha256": hashlib.sha256(BOT_KEY.encode()).hexdigest(),
                      "tenant": "legal"}]
    d["rate_limits"] = {
        "api_key": {"default": {"requests": "3/min"},
                    "overrides": {"contract-bot": {"requests": "5/min"}}},
        "tenant": {"overrides": {"small": {"requests": "2/min"},
                                 "thrifty": {"tokens": "100/min"},
                                 "streamy": {"tokens": "50/min"},
                                 "frugal": {"tokens": "50/min"}}},
        "model": {"overrides": {"bge-m3": {"requests": "4/min"}}},
    }
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-rl"))) as gateway:
        yield gateway


def client(gw: Gateway, key: str, tenant: str | None = None) -> openai.OpenAI:
    headers = {"x-tenant-id": tenant} if tenant else None
    return openai.OpenAI(base_url=gw.openai_base, api_key=key, default_headers=headers,
                         max_retries=0, timeout=10)


def chat(c: openai.OpenAI, max_tokens: int = 2) -> Any:
    return c.chat.completions.with_raw_response.create(
        model="llama-2-13b", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens)


def test_per_key_limit_denies_with_openai_json(gw: Gateway) -> None:
    c = client(gw, "sk-key-a")
    remaining = [int(chat(c).headers["x-ratelimit-remaining"]) for _ in range(3)]
    assert remaining == sorted(remaining, reverse=True) and remaining[0] > remaining[-1]
    with pytest.raises(openai.RateLimitError) as caught:
        chat(c)
    err = caught.value
    assert err.status_code == 429
    assert error_body(err)["code"] == "rate_limit_exceeded"
    assert error_body(err)["type"] == "requests"
    assert set(error_body(err)) == {"message", "type", "param", "code"}
    assert err.response.headers["content-type"] == "application/json"
    assert int(err.response.headers["retry-after"]) >= 1
    assert err.response.headers["x-ratelimit-remaining"] == "0"
    # Another key is not affected.
    assert chat(client(gw, "sk-key-b")).parse().choices


def test_listed_key_gets_its_override(gw: Gateway) -> None:
    c = client(gw, BOT_KEY)
    for _ in range(5):
        chat(c)
    with pytest.raises(openai.RateLimitError):
        chat(c)


def test_per_tenant_limit_spans_keys(gw: Gateway) -> None:
    chat(client(gw, "sk-t1", "small"))
    chat(client(gw, "sk-t2", "small"))
    with pytest.raises(openai.RateLimitError):
        chat(client(gw, "sk-t3", "small"))
    assert chat(client(gw, "sk-t4", "roomy")).parse().choices


def test_per_model_limit(gw: Gateway) -> None:
    for i in range(4):
        client(gw, f"sk-m{i}").embeddings.create(model="bge-m3", input="x")
    with pytest.raises(openai.RateLimitError):
        client(gw, "sk-m9").embeddings.create(model="bge-m3", input="x")
    assert chat(client(gw, "sk-m10")).parse().choices  # the chat model is not limited


def denied_soon(gw: Gateway, tenant: str) -> openai.RateLimitError:
    """The next request of ``tenant`` (a fresh key, so only the tenant's token bucket can deny),
    retried briefly: Envoy settles the previous request when its stream is done, a moment after
    the client has read it."""
    deadline = time.monotonic() + 5
    for attempt in itertools.count():
        try:
            chat(client(gw, f"sk-{tenant}-probe-{attempt}", tenant))
        except openai.RateLimitError as err:
            return err
        assert time.monotonic() < deadline, "the token bucket never denied"
        time.sleep(0.05)
    raise AssertionError("unreachable")


def test_token_limit_denies_once_reservations_and_usage_exhaust_it(gw: Gateway) -> None:
    c = client(gw, "sk-tok-1", "thrifty")
    first = chat(c, max_tokens=60).parse()  # reserves prompt + 60 of the 100; uses about as much
    assert 60 < first.usage.total_tokens < 100
    err = denied_soon(gw, "thrifty")
    assert error_body(err)["type"] == "tokens"


def test_a_streamed_request_reserves_its_tokens_too(gw: Gateway) -> None:
    stream = client(gw, "sk-s1", "streamy").chat.completions.create(
        model="llama-2-13b", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) == 30
    assert error_body(denied_soon(gw, "streamy"))["type"] == "tokens"


def test_rejected_requests_charge_no_tokens(gw: Gateway) -> None:
    c = client(gw, "sk-r1", "frugal")
    for _ in range(3):  # 404s from extproc: nothing served, nothing charged
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # The bucket is still whole: a reservation of prompt + 30 of its 50 is admitted.
    assert chat(c, max_tokens=30).parse().usage.total_tokens < 50
