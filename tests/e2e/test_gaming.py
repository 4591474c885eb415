"""Limits a client tries to get around, through real Envoy with rate limits: borrowing a listed
tenant, bad tenant values, buying priority, oversized requests; and the reservation Envoy gets."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body

ACME_KEY, SOLO_KEY = "sk-acme-listed", "sk-solo-listed"


def doc() -> dict[str, Any]:
    d = default_doc()
    d["api_keys"] = [
        {"name": "acme-bot", "sha256": hashlib.sha256(ACME_KEY.encode()).hexdigest(),
         "tenant": "acme"},
        {"name": "solo", "sha256": hashlib.sha256(SOLO_KEY.encode()).hexdigest()},
    ]
    d["rate_limits"] = {"tenant": {"overrides": {"acme": {"requests": "3/h"},
                                                 "solo": {"requests": "2/h"},
                                                 "mime": {"requests": "1/h"}}}}
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-gaming")),
                         capture_logs=True) as gateway:
        yield gateway


def client(gw: Gateway, key: str, tenant: str | None = None) -> openai.OpenAI:
    headers = {"x-tenant-id": tenant} if tenant else None
    return openai.OpenAI(base_url=gw.openai_base, api_key=key, default_headers=headers,
                         max_retries=0, timeout=10)


def chat(c: openai.OpenAI, content: str = "hi", **extra: Any) -> Any:
    return c.chat.completions.create(
        model="llama-2-13b", messages=[{"role": "user", "content": content}], **extra)


def post(gw: Gateway, headers: list[tuple[str, bytes]], content: str = "hi") -> tuple[int, Any]:
    """A chat request with exactly ``headers`` (raw bytes, repeats kept, no key unless given)."""
    url = urllib.parse.urlsplit(gw.url)
    body = json.dumps({"model": "llama-2-13b", "max_tokens": 1,
                       "messages": [{"role": "user", "content": content}]}).encode()
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for name, value in [*headers, ("content-type", b"application/json"),
                            ("content-length", str(len(body)).encode())]:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def served_tenants(gw: Gateway, marker: str) -> list[str]:
    """x-llm-tenant of the requests the short pool served whose prompt carried ``marker``."""
    return [r["headers"]["x-llm-tenant"] for r in gw.sim_requests("vllm-short")
            if marker in json.dumps(r.get("body"))]


def test_a_random_key_naming_a_listed_tenant_does_not_spend_it(gw: Gateway) -> None:
    marker = f"spoof-{uuid.uuid4().hex[:8]}"
    for _ in range(5):  # acme allows 3 an hour: spending it would 429 the 4th
        assert chat(client(gw, f"sk-{uuid.uuid4().hex}", "acme"), marker, max_tokens=1).choices
    assert post(gw, [("x-tenant-id", b"acme")], marker)[0] == 200  # no key at all: the same
    assert served_tenants(gw, marker) == ["default"] * 6
    acme = client(gw, ACME_KEY)
    for _ in range(3):  # the real tenant still has its whole bucket ...
        assert chat(acme, max_tokens=1).choices
    with pytest.raises(openai.RateLimitError) as caught:  # ... and it is enforced
        chat(acme, max_tokens=1)
    assert error_body(caught.value)["type"] == "requests"


def test_a_listed_key_without_tenant_is_its_own_tenant(gw: Gateway) -> None:
    marker = f"solo-{uuid.uuid4().hex[:8]}"
    solo = client(gw, SOLO_KEY, "someone-else")  # its tenant header is not read
    for _ in range(2):
        assert chat(solo, marker, max_tokens=1).choices
    assert served_tenants(gw, marker) == ["solo", "solo"]
    with pytest.raises(openai.RateLimitError):
        chat(solo, max_tokens=1)
    # Anonymous callers no longer share its tenant, and cannot claim it by name.
    assert post(gw, [])[0] == 200
    assert chat(client(gw, "sk-random-solo", "solo"), marker, max_tokens=1).choices
    assert served_tenants(gw, marker) == ["solo", "solo", "default"]


@pytest.mark.parametrize("value", [
    "t" * 65,  # was cut to 64 characters
    "acme corp",
    "acme,solo",
])
def test_a_bad_tenant_header_is_a_400_naming_it(gw: Gateway, value: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client(gw, "sk-random-bad-tenant", value), max_tokens=1)
    body = error_body(caught.value)
    assert (body["code"], body["param"], body["type"]) == (
        "invalid_tenant", "x-tenant-id", "invalid_request_error")
    assert caught.value.response.headers["content-type"] == "application/json"


@pytest.mark.parametrize("headers", [
    [("x-tenant-id", "acm\u00e9".encode())],  # a Unicode letter, as UTF-8 on the wire
    [("x-tenant-id", "acme-\u0663".encode())],  # an Arabic-Indic digit
    [("x-tenant-id", b"acme"), ("x-tenant-id", b"solo")],  # the header twice
])
def test_unicode_and_repeated_tenant_headers_are_400(gw: Gateway,
                                                     headers: list[tuple[str, bytes]]) -> None:
    status, body = post(gw, headers)
    assert (status, body["error"]["code"]) == (400, "invalid_tenant")


def test_a_listed_key_ignores_a_bad_tenant_header(gw: Gateway) -> None:
    # acme's request bucket may be empty by now: a 429 also proves the header was not a 400.
    with pytest.raises(openai.RateLimitError):
        chat(client(gw, ACME_KEY, "t" * 65), max_tokens=1)


def test_bounds_are_400_before_vllm(gw: Gateway) -> None:
    before = {name: len(gw.sim_requests(name)) for name in ("vllm-short", "vllm-long")}
    c = client(gw, "sk-bounds")
    with pytest.raises(openai.BadRequestError) as caught:
        chat(c, n=129, max_tokens=1)
    assert (error_body(caught.value)["code"], error_body(caught.value)["param"]) == ("invalid_request", "n")
    assert "at most 128" in error_body(caught.value)["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model="llama-2-13b", prompt=[[7]] * 2049, max_tokens=1)
    assert error_body(caught.value)["param"] == "prompt" and "2048" in error_body(caught.value)["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model="llama-2-13b", prompt=[[7] * 500_001] * 2, max_tokens=1)
    assert "1000000 token ids" in error_body(caught.value)["message"]
    assert {name: len(gw.sim_requests(name)) for name in before} == before


def test_max_completion_tokens_0_does_not_buy_high_priority(gw: Gateway) -> None:
    marker = f"prio-{uuid.uuid4().hex[:8]}"
    # 6000 bytes + marker: ~2020 tokens; with the default 256 output the weight is above 500.
    chat(client(gw, "sk-prio"), marker + "x" * 6000, max_completion_tokens=0)
    served = [r for r in gw.sim_requests("vllm-long") if marker in json.dumps(r.get("body"))]
    assert [r["headers"]["x-llm-priority"] for r in served] == ["medium"]


def access_log_line(gw: Gateway, tenant: str) -> dict[str, Any]:
    """Envoy's access log line of the request of ``tenant`` (written once the stream ends)."""
    deadline = time.monotonic() + 10
    while True:
        with open(os.path.join(gw.workdir, "envoy.log"), encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("{") and f'"tenant":"{tenant}"' in line:
                    entry: dict[str, Any] = json.loads(line)
                    return entry
        assert time.monotonic() < deadline, f"no access log line for tenant {tenant}"
        time.sleep(0.1)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 13_600}}


def test_a_key_in_the_query_reaches_neither_a_pool_nor_the_access_log(gw: Gateway) -> None:
    tenant = f"query-{uuid.uuid4().hex[:8]}"
    request = urllib.request.Request(
        f"{gw.url}/v1/chat/completions?key=sk-in-the-query",
        data=json.dumps({"model": "llama-2-13b", "max_tokens": 1,
                         "messages": [{"role": "user", "content": tenant}]}).encode(),
        headers={"content-type": "application/json", "x-tenant-id": tenant})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
    [seen] = [r for r in gw.sim_requests("vllm-short") if tenant in json.dumps(r.get("body"))]
    assert seen["path"] == "/v1/chat/completions" and not seen["query"]
    assert access_log_line(gw, tenant)["path"] == "/v1/chat/completions"
    with open(os.path.join(gw.workdir, "envoy.log"), encoding="utf-8") as handle:
        assert "sk-in-the-query" not in handle.read()


# best_of (which vLLM V1 dropped) is covered by tests/extproc.
@pytest.mark.parametrize(("make", "reservation"), [
    # "hello": ceil(5 / 3) = 2 tokens + 8 per message + 8 per chat prompt, + 10 of output.
    (lambda c: chat(c, "hello", max_tokens=10), 18 + 10),
    # n = 3: three answers of up to 10 tokens for one prompt.
    (lambda c: chat(c, "hello", max_tokens=10, n=3), 18 + 3 * 10),
    # max_completion_tokens 0 is "not set": the model's default_max_tokens, 256.
    (lambda c: chat(c, "hello", max_completion_tokens=0), 18 + 256),
    # Three prompts of 1, 2 and 3 tokens, 5 tokens of output each.
    (lambda c: c.completions.create(model="llama-2-13b", prompt=["abc", "abcdef", "abcdefghi"],
                                    max_tokens=5), 1 + 2 + 3 + 5 * 3),
    # Two images: ~27,000 bytes of base64 that is no prompt text, 1,024 tokens each (the
    # default media_tokens.image); with "hello", the chat allowance and 10 of output.
    (lambda c: c.chat.completions.create(model="llama-2-13b", max_tokens=10, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hello"}, IMAGE, IMAGE]}]),
     18 + 2 * 1024 + 10),
    # An assistant's refusal part is prompt text the template renders: 300 bytes, 100 tokens.
    (lambda c: c.chat.completions.create(model="llama-2-13b", max_tokens=10, messages=[
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "x" * 300}]}]),
     2 + 100 + 2 * 8 + 8 + 10),
])
def test_envoy_receives_the_reservation_as_dynamic_metadata(gw: Gateway, make: Any,
                                                            reservation: int) -> None:
    tenant = f"resv-{uuid.uuid4().hex[:8]}"
    make(client(gw, "sk-reservation", tenant))
    assert access_log_line(gw, tenant)["reservation"] == reservation


def test_a_body_that_is_not_json_is_refused_before_a_pool_or_a_limit(gw: Gateway) -> None:
    """curl -d without -H sends form-encoded; vLLM refuses that, so the gateway does, at the
    headers: a 415 that says what to send, no pod reached, no request counted against the
    tenant's 1 per hour."""
    marker = f"mime-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"model": "llama-2-13b", "max_tokens": 1,
                       "messages": [{"role": "user", "content": marker}]}).encode()
    url = urllib.parse.urlsplit(gw.url)
    for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = {"x-tenant-id": "mime", "content-length": str(len(body))}
        if content_type is not None:
            headers["content-type"] = content_type
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        try:
            conn.request("POST", "/v1/chat/completions", body, headers)  # no header added
            response = conn.getresponse()
            status, error = response.status, json.loads(response.read())["error"]
        finally:
            conn.close()
        assert status == 415, (content_type, error)
        assert (error["code"], error["param"]) == ("unsupported_media_type", "content-type")
    assert served_tenants(gw, marker) == []
    good = client(gw, "sk-mime", "mime")
    chat(good, marker, max_tokens=1)  # the tenant's one request of the hour is still there
    with pytest.raises(openai.RateLimitError):
        chat(good, marker, max_tokens=1)
