"""The walking skeleton through real Envoy: routing by context length, errors, streaming."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.harness.gateway import Gateway
from tests.harness.openai_types import error_body, usage_of, user


def client(gw: Gateway, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="sk-test-skeleton",
                         default_headers=headers or None, max_retries=0, timeout=30)


def chat(gw: Gateway, content: str = "Hello there", *, hint: int | None = None,
         max_tokens: int | None = 4) -> tuple[Any, str]:
    """Send one chat request; the response and the pool (simulator) that served it."""
    headers = {"X-Context-Length": str(hint)} if hint is not None else {}
    raw = client(gw, **headers).chat.completions.with_raw_response.create(
        model="llama-2-13b", messages=user(content),
        max_tokens=openai.omit if max_tokens is None else max_tokens)
    return raw.parse(), raw.headers["x-sim-name"]


def post_raw(gw: Gateway, path: str, body: bytes,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(f"{gw.url}{path}", data=body, method="POST",
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def test_non_streaming_chat_goes_to_the_short_pool(gateway: Gateway) -> None:
    response, pool = chat(gateway)
    assert pool == "vllm-short"
    assert response.choices[0].message.content
    assert response.usage is not None and response.usage.completion_tokens == 4


def test_streaming_chat_delivers_the_first_chunk_before_generation_ends(gateway: Gateway) -> None:
    started = time.monotonic()
    stream = client(gateway).chat.completions.create(
        model="llama-2-13b", messages=[{"role": "user", "content": "Count slowly"}],
        max_tokens=150, stream=True, stream_options={"include_usage": True})
    first_at: float | None = None
    last_at = 0.0
    text, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last_at = time.monotonic() - started
            if first_at is None:
                first_at = last_at
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    total = time.monotonic() - started
    assert first_at is not None
    # 150 tokens at the simulator's 2 ms each take ≥ 300 ms; the first must not wait for them:
    # the tokens arrive spread over the generation (a buffered answer would bring them at once;
    # a loaded machine only spreads them more).
    assert total >= 0.3
    assert last_at - first_at >= 0.15, (first_at, last_at)
    assert usage is not None and usage.completion_tokens == 150
    assert len(text) == 150


def test_completions_and_embeddings_work_through_envoy(gateway: Gateway) -> None:
    c = client(gateway)
    raw = c.completions.with_raw_response.create(model="llama-2-13b", prompt="Once upon",
                                                 max_tokens=5)
    assert raw.headers["x-sim-name"] == "vllm-short"
    assert usage_of(raw.parse()).completion_tokens == 5
    raw_e = c.embeddings.with_raw_response.create(model="bge-m3", input=["a", "b", "c"])
    assert raw_e.headers["x-sim-name"] == "embed"
    data = raw_e.parse().data
    assert [d.index for d in data] == [0, 1, 2] and len(data[0].embedding) > 0


@pytest.mark.parametrize(("hint", "pool"), [
    (2048, "vllm-short"), (2049, "vllm-long"), (32768, "vllm-long"),
])
def test_context_length_header_picks_the_pool(gateway: Gateway, hint: int, pool: str) -> None:
    _, served = chat(gateway, hint=hint, max_tokens=1)
    assert served == pool


def test_context_length_above_every_pool_is_413(gateway: Gateway) -> None:
    gateway.clear_sims()
    with pytest.raises(openai.APIStatusError) as caught:
        chat(gateway, hint=32769, max_tokens=1)
    err = caught.value
    assert err.status_code == 413
    assert error_body(err)["code"] == "context_length_exceeded"
    assert error_body(err)["type"] == "invalid_request_error"
    assert "32768" in error_body(err)["message"]
    assert all(gateway.sim_requests(c) == [] for c in gateway.sims)


def test_a_small_hint_never_lowers_a_long_prompt(gateway: Gateway) -> None:
    long_prompt = "word " * 3000  # ~5000 tokens by any count
    _, served = chat(gateway, long_prompt, hint=10, max_tokens=1)
    assert served == "vllm-long"


def test_without_a_header_prompt_and_max_tokens_decide(gateway: Gateway) -> None:
    assert chat(gateway, "short", max_tokens=16)[1] == "vllm-short"
    assert chat(gateway, "short", max_tokens=3000)[1] == "vllm-long"
    # 6000 bytes estimate to 2000 tokens (+16 chat template): with 16 output tokens that fits
    # 2048, with no max_tokens the model's default_max_tokens (256) counts and it does not.
    assert chat(gateway, "x " * 3000, max_tokens=16)[1] == "vllm-short"
    assert chat(gateway, "x " * 3000, max_tokens=None)[1] == "vllm-long"


@pytest.mark.parametrize(("body", "status", "code"), [
    (b'{"model": "llama-2-13b", "messages": [', 400, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "invalid_request"),
    (b'{"model": 42, "messages": [{"role": "user", "content": "hi"}]}', 400, "invalid_request"),
    (b'{"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]}', 404,
     "model_not_found"),
    (b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": 7}]}', 400,
     "invalid_request"),
    (b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": -5}', 400, "invalid_request"),
])
def test_bad_requests_get_openai_errors_and_never_reach_vllm(
        gateway: Gateway, body: bytes, status: int, code: str) -> None:
    gateway.clear_sims()
    got, headers, payload = post_raw(gateway, "/v1/chat/completions", body)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert payload["error"]["code"] == code
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error"
    assert all(gateway.sim_requests(c) == [] for c in gateway.sims)
    # extproc keeps serving after every bad request.
    assert chat(gateway)[1] == "vllm-short"


def test_openai_sdk_raises_typed_errors(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError):
        client(gateway).chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client(gateway).embeddings.create(model="llama-2-13b", input="chat model")


def test_model_list_comes_from_the_config(gateway: Gateway) -> None:
    ids = {m.id for m in client(gateway).models.list()}
    assert ids == {"llama-2-13b", "bge-m3"}


def test_unknown_path_is_a_json_404(gateway: Gateway) -> None:
    got, _, payload = post_raw(gateway, "/v1/nope", b"{}")
    assert got == 404 and payload["error"]["code"] == "unknown_url"


def test_upstream_sees_the_routing_headers(gateway: Gateway) -> None:
    gateway.clear_sims()
    chat(gateway)
    [seen] = gateway.sim_requests("vllm-short")
    headers = seen["headers"]
    assert headers["x-llm-cluster"] == "vllm-short"
    assert headers["x-llm-model"] == "llama-2-13b"
    assert headers["x-llm-variant"] == "stable"
    assert headers["x-llm-priority"] in {"high", "medium", "low"}
    assert int(headers["x-llm-context-length"]) > 4
    assert "sk-test-skeleton" not in headers["x-llm-key-id"]
