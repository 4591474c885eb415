"""A stream's usage read by Envoy (sse_to_metadata; a Lua filter strips a usage chunk the client
did not ask for), not by extproc (issue 16), through real Envoy 1.40: settled exactly, never for
an aborted stream, and with three ext_proc messages instead of one per token.

``telemetry.sample: 0`` and ``sample_min_per_s: 0``: no stable request is read for telemetry,
so every request Envoy can read the usage of is left to Envoy. Each test has its own tenant.
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.chaos.support import metric, wait_until
from tests.harness import charges
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body, user

pytestmark = pytest.mark.e2e

MESSAGES = user("hi")
DAY_CAP = 100_000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = default_doc()
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 20}
    d["telemetry"] = {"sample": 0, "sample_min_per_s": 0, "envoy_usage": True}
    # ``chunky`` always goes to its canary (so extproc reads every stream of it), whose pods
    # send four tokens a chunk (vLLM's --stream-interval).
    d["clusters"]["vllm-canary"]["simulate"] = {"decode_ms_per_token": 0.2, "stream_interval": 4}
    d["models"]["chunky"] = {"clusters": ["vllm-long"], "canary": {
        "model": "chunky-v2", "cluster": "vllm-canary", "percent": 100, "sticky": "request"}}
    # 100k/d refills ~1.2 tokens/s: a settle is visible to the token.
    d["rate_limits"] = {"tenant": {"overrides": {
        name: {"tokens": f"{DAY_CAP}/d"}
        for name in ("json", "sse", "plain", "cont", "chunky", "n-json", "n-sse", "n-chunky")
    } | {name: {"tokens": "100/h"} for name in ("abort-usage", "abort-running")}}}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-envoy-usage"))) as gateway:
        yield gateway


def client(gw: Gateway, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                         timeout=30, default_headers={"x-tenant-id": tenant})


def settled(gw: Gateway) -> float:
    return metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens")


def ext_proc_messages(gw: Gateway) -> float:
    with urllib.request.urlopen(f"{gw.admin_url}/stats?filter=ext_proc.stream_msgs_sent",
                                timeout=5) as resp:
        return sum(float(line.rsplit(":", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.strip())



def charged_by(gw: Gateway, tenant: str, send: Callable[[], int]) -> tuple[int, int, int]:
    """:func:`tests.harness.charges.charged_by` for ``tenant``."""
    return charges.charged_by(client(gw, tenant).chat.completions.with_raw_response.create,
                              lambda: settled(gw), send, DAY_CAP)


def test_a_non_streamed_answer_is_still_read_by_extproc(gw: Gateway) -> None:
    """Settled to its usage exactly (the probes, non-streamed too, also are) by extproc, from its
    one body message: four ext_proc messages, as before."""
    counted: list[float] = []

    def send() -> int:
        before = ext_proc_messages(gw)
        answer = client(gw, "json").chat.completions.create(
            model="llama-2-13b", messages=MESSAGES, max_tokens=7)
        wait_until(lambda: ext_proc_messages(gw) >= before + 4, 10, 0.05)
        counted.append(ext_proc_messages(gw) - before)
        assert answer.usage is not None
        return answer.usage.total_tokens

    lost, total, refill = charged_by(gw, "json", send)
    assert total - refill <= lost <= total
    assert counted == [4]


def test_a_stream_that_asked_for_usage_is_settled_by_envoy_per_request_not_per_token(
        gw: Gateway) -> None:
    counted: list[float] = []

    def send() -> int:
        before = ext_proc_messages(gw)
        stream = client(gw, "sse").chat.completions.create(
            model="llama-2-13b", messages=MESSAGES, max_tokens=40, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 40
        usage = chunks[-1].usage  # the client asked for it, so it gets it
        assert usage is not None and not chunks[-1].choices
        wait_until(lambda: ext_proc_messages(gw) >= before + 3, 10, 0.05)
        counted.append(ext_proc_messages(gw) - before)
        return usage.total_tokens

    lost, total, refill = charged_by(gw, "sse", send)
    assert total - refill <= lost <= total
    assert counted == [3]  # not 3 + one per token


def test_a_stream_that_did_not_ask_for_usage_sees_none_and_is_settled_by_envoy(
        gw: Gateway) -> None:
    """extproc asks vLLM for the usage chunk, Envoy reads it and strips it: the client gets
    exactly the stream it asked for (raw bytes: every event a content chunk, then [DONE]), the
    settle is vLLM's usage, and the stream costs three ext_proc messages."""
    counted: list[float] = []
    prompt = probe_prompt_tokens(gw)

    def send() -> int:
        before = ext_proc_messages(gw)
        url = urlsplit(gw.url)
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "llama-2-13b", "messages": MESSAGES, "max_tokens": 12, "stream": True}),
            {"authorization": "Bearer sk-plain", "x-tenant-id": "plain",
             "content-type": "application/json"})
        raw = conn.getresponse().read().decode()
        conn.close()
        events = [e for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]", raw
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all(c["choices"] and not c.get("usage") for c in chunks), raw
        content = sum(1 for c in chunks if c["choices"][0]["delta"].get("content"))
        assert content == 12
        wait_until(lambda: ext_proc_messages(gw) >= before + 3, 10, 0.05)
        counted.append(ext_proc_messages(gw) - before)
        # What vLLM counted (the simulator's prompt count), as the stripped chunk said it.
        return content + prompt

    lost, total, refill = charged_by(gw, "plain", send)
    assert total - refill <= lost <= total
    assert counted == [3]


def raw_stream(gw: Gateway, tenant: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks a client receives, read off the wire (every event a JSON chunk, then
    ``[DONE]``)."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"authorization": f"Bearer sk-{tenant}", "x-tenant-id": tenant,
                  "content-type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", raw
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_stream_extproc_reads_is_settled_from_vllms_usage_not_by_counting_chunks(
        gw: Gateway) -> None:
    """The canary's stream, read by extproc, four tokens a chunk, and a client that asked for
    per-chunk usage without ``include_usage`` (vLLM then sends none): vLLM is asked for its
    usage chunk, the client still sees none, and the bucket pays every token, not one a chunk
    (40 tokens came as 10 chunks)."""
    prompt = probe_prompt_tokens(gw)

    def send() -> int:
        chunks = raw_stream(gw, "chunky", {
            "model": "chunky", "messages": MESSAGES, "max_tokens": 40,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
        assert all(c["choices"] and not c.get("usage") for c in chunks), chunks
        content = [c["choices"][0]["delta"].get("content") for c in chunks]
        assert len([text for text in content if text]) == 10
        return 40 + prompt

    lost, total, refill = charged_by(gw, "chunky", send)
    assert total - refill <= lost <= total


def probe_prompt_tokens(gw: Gateway) -> int:
    """The simulator's prompt count (asked on another tenant: this one's bucket is measured),
    once its own settle is done (it must not count as the measured request's)."""
    settles = settled(gw)
    answer = client(gw, "cont").chat.completions.create(
        model="llama-2-13b", messages=MESSAGES, max_tokens=1)
    wait_until(lambda: settled(gw) >= settles + 1, 10, 0.05)
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def open_stream(gw: Gateway, tenant: str, options: dict[str, Any]) -> http.client.HTTPConnection:
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body = {"model": "llama-2-13b", "messages": MESSAGES, "stream": True, "max_tokens": 60,
            "stream_options": options}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"authorization": f"Bearer sk-{tenant}", "x-tenant-id": tenant,
                  "content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    read = 0
    while read < 6:
        if response.readline().strip():
            read += 1
    return conn


@pytest.mark.parametrize(("tenant", "options"), [
    ("abort-usage", {"include_usage": True}),
    ("abort-running", {"include_usage": True, "continuous_usage_stats": True})])
def test_an_aborted_stream_keeps_its_reservation(gw: Gateway, tenant: str,
                                                 options: dict[str, Any]) -> None:
    """Hung up after a few tokens: with Envoy reading the usage chunk (none came), and with
    vLLM's running usage on every chunk (extproc reads those streams: Envoy would settle the
    running count), nothing is settled and the next request does not fit."""
    before = settled(gw)
    open_stream(gw, tenant, options).close()
    # Another request's settle comes after the abort's stream-done call would have.
    client(gw, "json").chat.completions.create(model="llama-2-13b", messages=MESSAGES,
                                               max_tokens=1)
    wait_until(lambda: settled(gw) >= before + 1, 10, 0.05)
    # Settled, the stream (~20 tokens of a 77-token reservation) would leave room for this one.
    with pytest.raises(openai.RateLimitError) as caught:
        client(gw, tenant).chat.completions.create(model="llama-2-13b", messages=MESSAGES,
                                                    max_tokens=60)
    assert error_body(caught.value)["type"] == "tokens"


def test_an_upstream_error_is_settled_to_zero(gw: Gateway) -> None:
    """A vLLM 400 to a stream extproc does not read: settled 0 from the response headers."""
    settles = settled(gw)
    with pytest.raises(openai.BadRequestError):
        client(gw, "cont").chat.completions.create(model="llama-2-13b", messages=MESSAGES,
                                                   max_tokens=5, stream=True,
                                                   extra_body={"min_tokens": 10})  # vLLM's 400
    wait_until(lambda: settled(gw) >= settles + 1, 10, 0.05)


def test_a_large_non_streamed_answer_is_never_held_by_envoy(gw: Gateway) -> None:
    """An ~11 MB embeddings answer, above Envoy's 8 MiB buffer: nothing in the usage filters
    holds it (json_to_metadata did, and turned it into a 500)."""
    body = json.dumps({"model": "bge-m3", "input": [f"document {i}" for i in range(2048)]})
    request = urllib.request.Request(f"{gw.url}/v1/embeddings", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200 and len(json.loads(resp.read())["data"]) == 2048


@pytest.mark.parametrize(("tenant", "model", "stream"), [
    ("n-json", "llama-2-13b", False),  # extproc reads the answer
    ("n-sse", "llama-2-13b", True),    # Envoy reads the usage chunk, the Lua filter strips it
    ("n-chunky", "chunky", True),      # extproc reads the canary's stream, 4 tokens a chunk
])
def test_n_choices_are_settled_to_every_choices_tokens(gw: Gateway, tenant: str, model: str,
                                                       stream: bool) -> None:
    """``n: 3`` brings three answers for one admission: the settlement is vLLM's usage, the
    tokens of all three (a settlement that read one choice would charge a third), and a client
    that did not ask for the usage chunk gets the three choices and no usage."""
    prompt = probe_prompt_tokens(gw)

    def send() -> int:
        c = client(gw, tenant)
        if not stream:
            answer = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, n=3)
            assert [choice.index for choice in answer.choices] == [0, 1, 2]
            assert answer.usage is not None and answer.usage.completion_tokens == 18
            return answer.usage.total_tokens
        chunks = list(c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                                n=3, stream=True))
        assert all(chunk.choices and chunk.usage is None for chunk in chunks)
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        assert sorted(texts) == [0, 1, 2]
        assert [len(texts[i].split()) for i in range(3)] == [6, 6, 6]  # a word a token
        return prompt + 18

    lost, total, refill = charged_by(gw, tenant, send)
    assert total - refill <= lost <= total, (lost, total)
