"""Token reservations, abort-safe charging, concurrency caps and shadow limits through real
Envoy, on the memory backend and on a real Redis (docs: Rate limits).

Each test uses its own tenant (or key), so the module's gateways are shared. A request's
reservation is read off OpenAI's ``x-ratelimit-remaining-tokens`` header of a first request on
a roomy tenant, so the tests do not depend on how extproc counts a prompt.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from openai._legacy_response import LegacyAPIResponse
from openai.types.chat import ChatCompletion

from tests.chaos.replicas import add_to_envoy, start_replica
from tests.chaos.support import metric, wait_until
from tests.harness.ci import unavailable
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import error_body, usage_of, user
from tests.harness.redis_servers import RedisServer

pytestmark = pytest.mark.e2e

ROOMY = 1_000_000
MESSAGES = user("hi")


def doc() -> dict[str, Any]:
    d = default_doc()
    # Slow enough that a stream is still running when the test acts on it.
    # natural_stop: a request without max_tokens is sent on with the 256 it reserved (docs:
    # Rate limits), and the model still ends its answer at 16, as a real one would.
    d["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 20, "natural_stop": True}
    # A slow prefill (~4 s for a short prompt): requests sent together are all in flight
    # together, whatever the machine's load. X-Context-Length sends a request here.
    d["clusters"]["vllm-long"]["simulate"] = {"prefill_ms_per_token": 500, "natural_stop": True}
    d["rate_limits"] = {
        "tenant": {"overrides": {
            "roomy": {"tokens": f"{ROOMY}/h"},
            "quad": {"tokens": "1200/h"},       # 4 reservations of ~273 fit, 5 do not
            "tiny": {"tokens": "100/h"},        # no reservation of ~273 ever fits
            "aborts": {"tokens": "300/h"},      # one reservation fits at a time
            "paced": {"concurrent": 2},
            "trial": {"requests": "1/h", "shadow": True},
        }},
    }
    return d


@pytest.fixture(scope="module", params=["memory", "redis"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    env = None
    if request.param == "redis":
        server: RedisServer | None = request.getfixturevalue("redis_server_module")
        if server is None:
            unavailable("redis")
        env = {"LLM_SIDECAR_REDIS_URL": server.url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}
    with running_gateway(doc(), str(tmp_path_factory.mktemp(f"gw-res-{request.param}")),
                         env=env) as gateway:
        yield gateway


def settled(gw: Gateway) -> float:
    """Token-bucket settlements the ratelimit service applied (from extproc or Envoy)."""
    return metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens")


def client(gw: Gateway, tenant: str, key: str = "sk-any") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=key, max_retries=0, timeout=30,
                         default_headers={"x-tenant-id": tenant})


def chat(gw: Gateway, tenant: str, **extra: Any) -> LegacyAPIResponse[ChatCompletion]:
    return client(gw, tenant).chat.completions.with_raw_response.create(
        model="llama-2-13b", messages=MESSAGES, **extra)


def reservation(gw: Gateway) -> int:
    """What one request of :func:`chat` (no max_tokens: the model's default 256) reserves."""
    left = int(chat(gw, "roomy").headers["x-ratelimit-remaining-tokens"])
    return ROOMY - left


def remaining_tokens(gw: Gateway, tenant: str) -> int:
    """The tenant's token bucket as a request sees it at admission (after its own reservation)."""
    return int(chat(gw, tenant).headers["x-ratelimit-remaining-tokens"])


def open_stream(gw: Gateway, tenant: str, max_tokens: int | None = None,
                lines: int = 1, context_length: int | None = None) -> http.client.HTTPConnection:
    """A streamed chat, admitted and read for ``lines`` SSE lines; close the connection to
    hang up mid-stream as a client would. ``context_length`` (X-Context-Length) above 2048
    sends it to the long pool's slow prefill."""
    url = urlsplit(gw.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body: dict[str, Any] = {"model": "llama-2-13b", "messages": MESSAGES, "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    headers = {"authorization": f"Bearer sk-{tenant}", "x-tenant-id": tenant,
               "content-type": "application/json"}
    if context_length is not None:
        headers["x-context-length"] = str(context_length)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    read = 0
    while read < lines:
        if response.readline().strip():
            read += 1
    return conn


def test_concurrent_requests_never_overshoot_and_refunds_admit_the_next(gw: Gateway) -> None:
    """20 requests arrive together at a bucket that fits 4 reservations: 4 are admitted. They
    use ~30 tokens each, so the refunds admit the next 4 at once."""
    before = settled(gw)
    reserved = reservation(gw)
    assert 4 * reserved <= 1200 < 5 * reserved, reserved
    # A request's settlements come in one call (extproc's batch or Envoy's stream-done call),
    # so the count moves once, by the number of token buckets a request settles.
    wait_until(lambda: settled(gw) > before, 10)
    per_request = settled(gw) - before

    def one(_: int) -> int:
        try:
            slow = chat(gw, "quad", extra_headers={"x-context-length": "4000"})
            return usage_of(slow.parse()).total_tokens
        except openai.RateLimitError:
            return -1

    settled_before = settled(gw)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        first = list(pool.map(one, range(20)))
    used = [u for u in first if u >= 0]
    assert len(used) == 4, first
    assert all(u < reserved for u in used)
    # Every request of the batch settles (a refused one settles nothing, but is counted), a
    # moment after its client read the answer: the refunds are in once all 20 are.
    wait_until(lambda: settled(gw) >= settled_before + 20 * per_request, 10)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        second = list(pool.map(one, range(20)))
    assert sum(u >= 0 for u in second) == (1200 - sum(used)) // reserved == 4, second


def test_a_reservation_that_can_never_fit_says_so(gw: Gateway) -> None:
    reserved = reservation(gw)
    with pytest.raises(openai.RateLimitError) as caught:
        chat(gw, "tiny")
    err = caught.value
    assert error_body(err)["type"] == "tokens" and error_body(err)["code"] == "rate_limit_exceeded"
    assert f"needs {reserved} tokens" in error_body(err)["message"] and "(100)" in error_body(err)["message"]
    assert "retry-after" not in err.response.headers  # no wait would admit it
    assert err.response.headers["x-should-retry"] == "false"
    # A request that fits is still admitted: nothing was taken by the refused one.
    assert chat(gw, "tiny", max_tokens=5).parse().choices


def test_an_abandoned_stream_keeps_its_reservation(gw: Gateway) -> None:
    """The client hangs up after a few tokens: usage is unknown, the reservation stands, so the
    next request does not fit. Before, such streams were charged nothing."""
    reserved = reservation(gw)
    assert reserved <= 300 < 2 * reserved - 60
    open_stream(gw, "aborts", lines=6).close()
    # Dropped mid-stream: nothing comes back (the stream-done call carries no usage).
    with pytest.raises(openai.RateLimitError) as caught:
        chat(gw, "aborts", max_tokens=60)
    assert error_body(caught.value)["type"] == "tokens"


def test_a_finished_stream_is_settled_to_its_usage(gw: Gateway) -> None:
    reserved = reservation(gw)
    stream = client(gw, "roomy").chat.completions.create(
        model="llama-2-13b", messages=MESSAGES, max_tokens=12, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) == 12
    # After the settle, the roomy bucket is down by the real usage of everything sent so far,
    # far less than the reservations.
    wait_until(lambda: ROOMY - remaining_tokens(gw, "roomy") < 3 * reserved, 10, 0.05)


def test_concurrency_cap_counts_streams_and_frees_slots_of_aborted_ones(gw: Gateway) -> None:
    # In the long pool's prefill (~4 s or more): both are in flight while the test acts.
    streams = [open_stream(gw, "paced", lines=0, context_length=4000) for _ in range(2)]
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            chat(gw, "paced", max_tokens=1)
        err = caught.value
        assert error_body(err)["type"] == "concurrent" and error_body(err)["code"] == "rate_limit_exceeded"
        assert err.response.headers["retry-after"] == "1"
        streams.pop().close()  # the client hangs up: its slot is released at stream done

        def admitted() -> bool:
            try:
                chat(gw, "paced", max_tokens=1)
            except openai.RateLimitError:
                return False
            return True

        wait_until(admitted, 10, 0.05)
    finally:
        for conn in streams:
            conn.close()


def test_a_shadow_limit_counts_but_never_denies(gw: Gateway) -> None:
    before = metric(gw.ratelimit_metrics, "ratelimit_decisions_total", level="tenant",
                    kind="requests", result="shadow_over_limit")
    for _ in range(4):  # the limit is 1/h
        assert chat(gw, "trial", max_tokens=1).parse().choices
    after = metric(gw.ratelimit_metrics, "ratelimit_decisions_total", level="tenant",
                   kind="requests", result="shadow_over_limit")
    assert after - before == 3


def test_openai_rate_limit_headers_on_every_answer(gw: Gateway) -> None:
    headers = chat(gw, "roomy", max_tokens=1).headers
    assert int(headers["x-ratelimit-limit-tokens"]) == ROOMY
    assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < ROOMY
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    # The IETF header Envoy builds never shows more remaining than its limit.
    assert int(headers["x-ratelimit-remaining"]) <= int(headers["x-ratelimit-limit"].split(",")[0])


def test_two_replicas_on_one_redis_enforce_one_global_reservation(
        tmp_path_factory: pytest.TempPathFactory, redis_server_module: RedisServer | None) -> None:
    """Envoy spreads decisions over two ratelimit (and two extproc) replicas sharing a Redis:
    20 requests at once against a bucket that fits 4 reservations still get 4 admissions."""
    if redis_server_module is None:
        unavailable("redis")
    env = {"LLM_SIDECAR_REDIS_URL": redis_server_module.url, "LLM_SIDECAR_REDIS_TIMEOUT_MS": "1000"}
    d = doc()
    d["rate_limits"]["tenant"]["overrides"]["global"] = {"tokens": "1200/h"}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-res-replicas")), env=env) as gw:
        extra = [("ratelimit", start_replica(gw, "ratelimit")),
                 ("extproc", start_replica(gw, "extproc"))]
        try:
            add_to_envoy(gw, extra)
            reserved = reservation(gw)
            assert 4 * reserved <= 1200 < 5 * reserved, reserved

            def one(_: int) -> bool:
                try:
                    chat(gw, "global", extra_headers={"x-context-length": "4000"})
                except openai.RateLimitError:
                    return False
                return True

            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                admitted = sum(pool.map(one, range(20)))
            assert admitted == 4
            served = [metric(url, "ratelimit_requests_total", code="ok")
                      + metric(url, "ratelimit_requests_total", code="over_limit")
                      for url in (gw.ratelimit_metrics, extra[0][1].metrics)]
            assert all(count > 0 for count in served), served
        finally:
            for _, replica in extra:
                replica.child.stop()
