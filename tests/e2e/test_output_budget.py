"""A request that sets no output budget, through real Envoy (docs: Rate limits): it gets the
budget its reservation assumed.

The short pool's simulated model answers 1,500 tokens when nothing stops it (vLLM gives a chat
request without ``max_tokens`` the rest of its window). Tenant ``metered`` has a token limit, the
default tenant none. The attack: set no budget, read the whole answer, hang up before the usage
chunk. The reservation (prompt + 256) then stands, so the answer must not be longer than 256.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import user

pytestmark = pytest.mark.e2e

NATURAL = 1500
BUDGET = 256


def doc() -> dict[str, Any]:
    d = default_doc()
    d["clusters"]["vllm-short"]["simulate"] = {"default_output_tokens": NATURAL,
                                               "decode_ms_per_token": 0.2}
    d["models"]["llama-2-13b"]["default_max_tokens"] = BUDGET
    d["rate_limits"] = {"tenant": {"overrides": {"metered": {"tokens": "1M/h"},
                                                 "trial": {"tokens": "1M/h", "shadow": True}}}}
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("gw-budget"))) as gateway:
        yield gateway


def client(gw: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                         timeout=30, default_headers={"x-tenant-id": tenant})


def upstream_budget(gw: Gateway, marker: str) -> object:
    """The ``max_tokens`` the short pool got with the request whose prompt carried ``marker``
    ("absent" when none)."""
    [body] = [r["body"] for r in gw.sim_requests("vllm-short") if marker in json.dumps(r["body"])]
    return body.get("max_tokens", "absent")


def test_a_stream_without_budget_dropped_before_its_usage_got_no_more_than_it_reserved(
        gw: Gateway) -> None:
    """Read every content chunk and the finish, then hang up: the usage never comes, the
    reservation stands, and it covered every token the client received."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body = {"model": "llama-2-13b", "messages": user("drop-1 write a long essay"),
            "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"authorization": "Bearer sk-metered", "x-tenant-id": "metered",
                  "content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    received, finish = 0, None
    while finish is None:
        line = response.readline()
        assert line, "the stream ended before its finish_reason"
        if not line.startswith(b"data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            received += bool(choice["delta"].get("content"))
            finish = choice.get("finish_reason") or finish
    conn.close()  # before the usage chunk and [DONE]
    assert (received, finish) == (BUDGET, "length")
    assert upstream_budget(gw, "drop-1") == BUDGET


def test_a_metered_answer_without_budget_ends_at_the_models_default(gw: Gateway) -> None:
    answer = client(gw, "metered").chat.completions.create(
        model="llama-2-13b", messages=user("plain-1 write a long essay"))
    assert answer.usage is not None and answer.usage.completion_tokens == BUDGET
    assert answer.choices[0].finish_reason == "length"


def test_a_budget_the_client_set_goes_on_as_sent(gw: Gateway) -> None:
    answer = client(gw, "metered").chat.completions.create(
        model="llama-2-13b", messages=user("own-1 write a long essay"), max_tokens=600)
    assert answer.usage is not None and answer.usage.completion_tokens == 600
    assert upstream_budget(gw, "own-1") == 600


@pytest.mark.parametrize("tenant", ["default", "trial"])
def test_without_an_enforcing_token_limit_vllm_decides_the_length(gw: Gateway,
                                                                  tenant: str) -> None:
    """No token limit (or only a shadow one) charges the request: its body goes on unchanged,
    and the model answers at its natural length."""
    marker = f"free-{tenant}"
    answer = client(gw, tenant).chat.completions.create(
        model="llama-2-13b", messages=user(f"{marker} write a long essay"))
    assert answer.usage is not None and answer.usage.completion_tokens == NATURAL
    assert answer.choices[0].finish_reason == "stop"
    assert upstream_budget(gw, marker) == "absent"


def test_min_tokens_above_the_default_is_the_budget_written_in(gw: Gateway) -> None:
    """vLLM refuses a min_tokens above max_tokens: the budget written in (and reserved) is the
    request's own minimum, so the request is served as it would be without the gateway."""
    answer = client(gw, "metered").chat.completions.create(
        model="llama-2-13b", messages=user("min-1 write a long essay"),
        extra_body={"min_tokens": 400})
    assert answer.usage is not None and answer.usage.completion_tokens == 400
    assert upstream_budget(gw, "min-1") == 400
