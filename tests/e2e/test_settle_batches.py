"""extproc settles what it read, batched, through real Envoy 1.40 (issue 16): charges stay
exact, and Envoy makes no stream-done rate-limit call for a request extproc settled (one RLS
call per non-streamed request from Envoy instead of two), unless a concurrency cap needs its
slot released (a cap at a level: on every request of that level).
``LLM_SIDECAR_SETTLE_BATCH_MS=0`` gives Envoy the settlement back.

``telemetry.sample: 1``: every response is read by extproc, so a stream whose client asked for
usage is the one left to Envoy (its sse_to_metadata reads it). Each test has its own tenant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.chaos.support import metric, wait_until
from tests.harness import charges
from tests.harness.charges import remaining
from tests.harness.gateway import Gateway, default_doc, running_gateway
from tests.harness.openai_types import user

pytestmark = pytest.mark.e2e

MESSAGES = user("hi")
DAY_CAP = 100_000
TENANTS = ("json", "sse", "sse-usage", "calls", "embed", "spoof", "victim", "error",
           "embed-error")


@pytest.fixture(scope="module", params=["batched", "envoy"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = default_doc()
    d["telemetry"] = {"sample": 1, "envoy_usage": True}
    # 100k/d refills ~1.2 tokens/s: a settle is visible to the token. No concurrency cap: one
    # on any tenant puts a release descriptor on every request's stream-done call
    # (tests/e2e/test_reservations.py covers caps with the batcher on).
    d["rate_limits"] = {"tenant": {"overrides": {
        name: {"tokens": f"{DAY_CAP}/d"} for name in TENANTS
    }}}
    # Every settlement batched, even one alone (the default leaves a quiet gateway's to Envoy).
    env = {"LLM_SIDECAR_SETTLE_BATCH_MS": "5" if request.param == "batched" else "0",
           "LLM_SIDECAR_SETTLE_BATCH_MIN": "1"}
    with running_gateway(d, str(tmp_path_factory.mktemp(f"gw-settle-{request.param}")),
                         env=env) as gateway:
        yield gateway


def batched(gw: Gateway) -> bool:
    return gw.env is not None and gw.env["LLM_SIDECAR_SETTLE_BATCH_MS"] != "0"


def client(gw: Gateway, tenant: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=f"sk-{tenant}", max_retries=0,
                         timeout=30, default_headers={"x-tenant-id": tenant, **headers})


def settled(gw: Gateway) -> float:
    return metric(gw.ratelimit_metrics, "ratelimit_settlements_total", what="tokens")


def rls_calls(gw: Gateway) -> float:
    """Every ShouldRateLimit call the ratelimit service answered (Envoy's and extproc's)."""
    return metric(gw.ratelimit_metrics, "ratelimit_requests_total")


def extproc_batches(gw: Gateway) -> float:
    return metric(gw.extproc_metrics, "llm_sidecar_extproc_settlement_batches_total")


def extproc_settled(gw: Gateway) -> float:
    return metric(gw.extproc_metrics, "llm_sidecar_extproc_settlements_total", result="ok")



def charged_by(gw: Gateway, tenant: str, send: Callable[[], int]) -> tuple[int, int, int]:
    """:func:`tests.harness.charges.charged_by` for ``tenant``; then waits for the second
    probe's settle too, so the next test starts quiet."""
    settles = settled(gw)
    charged = charges.charged_by(client(gw, tenant).chat.completions.with_raw_response.create,
                                 lambda: settled(gw), send, DAY_CAP)
    wait_until(lambda: settled(gw) >= settles + 3, 10, 0.05)
    return charged


def test_a_non_streamed_answer_is_charged_its_usage(gw: Gateway) -> None:
    def send() -> int:
        answer = client(gw, "json").chat.completions.create(
            model="llama-2-13b", messages=MESSAGES, max_tokens=9)
        assert answer.usage is not None
        return answer.usage.total_tokens

    lost, total, refill = charged_by(gw, "json", send)
    assert total - refill <= lost <= total


@pytest.mark.parametrize(("tenant", "usage"), [("sse", False), ("sse-usage", True)])
def test_a_stream_is_charged_its_usage(gw: Gateway, tenant: str, usage: bool) -> None:
    """Read by extproc (sampled): settled by extproc's batch, or, when the client asked for
    usage, by Envoy's sse_to_metadata; exactly once either way."""
    def send() -> int:
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
        chunks = list(client(gw, tenant).chat.completions.create(
            model="llama-2-13b", messages=MESSAGES, max_tokens=12, stream=True, **extra))
        content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
        assert content == 12
        if usage:
            assert chunks[-1].usage is not None
            return int(chunks[-1].usage.total_tokens)
        assert all(c.usage is None for c in chunks)
        return -1

    before = settled(gw)
    lost, total, refill = charged_by(gw, tenant, send)
    if total < 0:  # the client did not get the usage: the prompt (as vLLM counts it) + 12
        total = lost
        assert 12 < lost < 200
    assert total - refill <= lost <= total
    # probe + stream + probe: the stream settled once, not twice
    assert settled(gw) == before + 3


def test_envoy_makes_one_rate_limit_call_per_request_extproc_settles(gw: Gateway) -> None:
    """K non-streamed requests: K admission calls from Envoy and, batched, no stream-done call
    at all (the route has no concurrency cap), only extproc's batches; with the batcher off,
    Envoy's 2K as before."""
    k = 12
    calls, batches, settles = rls_calls(gw), extproc_batches(gw), settled(gw)
    taken = extproc_settled(gw)
    chat = client(gw, "calls").chat.completions.create
    for _ in range(k):
        chat(model="llama-2-13b", messages=MESSAGES, max_tokens=3)
    wait_until(lambda: settled(gw) >= settles + k, 10, 0.05)
    # extproc counts a batch once answered, the service before answering: wait for both.
    wait_until(lambda: extproc_settled(gw) >= taken + (k if batched(gw) else 0), 10, 0.05)
    wait_until(lambda: rls_calls(gw) >= calls + (k if batched(gw) else 2 * k), 10, 0.05)
    made_by_extproc = extproc_batches(gw) - batches
    made_by_envoy = rls_calls(gw) - calls - made_by_extproc
    if batched(gw):
        assert 1 <= made_by_extproc <= k
        assert made_by_envoy == k
    else:
        assert made_by_extproc == 0
        assert made_by_envoy == 2 * k
    assert settled(gw) == settles + k


def test_embeddings_are_settled_in_the_batches_too(gw: Gateway) -> None:
    """Embeddings answers are always read by extproc (usage, cache): K of them (inputs never
    seen, so none is a cache hit extproc answers itself) settle in extproc's batches, each
    once, and Envoy makes its K admission calls only; with the batcher off, 2K."""
    k = 8
    calls, batches, settles = rls_calls(gw), extproc_batches(gw), settled(gw)
    taken = extproc_settled(gw)
    embed = client(gw, "embed").embeddings.create
    for i in range(k):
        answer = embed(model="bge-m3", input=[f"settle me {i} {time.monotonic_ns()}"])
        assert answer.usage.total_tokens > 0
    wait_until(lambda: settled(gw) >= settles + k, 10, 0.05)
    wait_until(lambda: extproc_settled(gw) >= taken + (k if batched(gw) else 0), 10, 0.05)
    wait_until(lambda: rls_calls(gw) >= calls + (k if batched(gw) else 2 * k), 10, 0.05)
    made_by_extproc = extproc_batches(gw) - batches
    made_by_envoy = rls_calls(gw) - calls - made_by_extproc
    assert made_by_envoy == (k if batched(gw) else 2 * k)
    assert (made_by_extproc >= 1) == batched(gw)
    assert settled(gw) == settles + k


def test_an_embeddings_error_is_settled_to_zero(gw: Gateway) -> None:
    """vLLM refuses the request (``dimensions`` above the model's): its reservation of a few
    thousand tokens is given back, by extproc's batch or by Envoy, not kept."""
    embed = client(gw, "embed-error").embeddings.create
    chat = client(gw, "embed-error").chat.completions.with_raw_response.create
    settles = settled(gw)
    start = remaining(chat(model="llama-2-13b", messages=MESSAGES, max_tokens=1))
    with pytest.raises(openai.BadRequestError):
        embed(model="bge-m3", input=["word " * 2000], dimensions=100_000)
    wait_until(lambda: settled(gw) >= settles + 2, 10, 0.05)
    after = remaining(chat(model="llama-2-13b", messages=MESSAGES, max_tokens=1))
    assert after >= start - 40  # the ~2,000-token reservation is not kept


def test_spoofed_levels_settle_nobody_elses_bucket(gw: Gateway) -> None:
    """A client naming another tenant in extproc's own headers is routed, charged and settled
    as itself: the victim's bucket does not move."""
    victim = client(gw, "victim").chat.completions.with_raw_response.create
    settles = settled(gw)
    before = remaining(victim(model="llama-2-13b", messages=MESSAGES, max_tokens=1))
    spoofer = client(gw, "spoof", **{"x-llm-tenant": "victim", "x-llm-key-id": "victim",
                                     "x-llm-model": "other"})
    started = time.monotonic()
    for _ in range(3):
        spoofer.chat.completions.create(model="llama-2-13b", messages=MESSAGES, max_tokens=20)
    wait_until(lambda: settled(gw) >= settles + 4, 10, 0.05)
    after = victim(model="llama-2-13b", messages=MESSAGES, max_tokens=1)
    refill = int((time.monotonic() - started) * DAY_CAP / 86400) + 2
    # The victim lost only its own first probe's usage (a few tokens), nothing of the spoofer's.
    assert before - 40 <= remaining(after) <= before + refill


def test_an_upstream_error_is_settled_to_zero(gw: Gateway) -> None:
    chat = client(gw, "error").chat.completions.with_raw_response.create
    settles = settled(gw)
    start = remaining(chat(model="llama-2-13b", messages=MESSAGES, max_tokens=1))
    with pytest.raises(openai.BadRequestError):
        chat(model="llama-2-13b", messages=MESSAGES, max_tokens=50,
             extra_body={"min_tokens": 60})  # vLLM's 400
    wait_until(lambda: settled(gw) >= settles + 2, 10, 0.05)
    after = remaining(chat(model="llama-2-13b", messages=MESSAGES, max_tokens=1))
    assert after >= start - 40  # nothing of the 50-token reservation kept


def test_a_draining_extproc_sends_its_last_batch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With a batch interval longer than the test, the settlement waits in extproc's queue;
    SIGTERM drains extproc, which sends it before exiting: the reservation is settled."""
    d = default_doc()
    d["telemetry"] = {"sample": 1}
    d["rate_limits"] = {"tenant": {"default": {"tokens": f"{DAY_CAP}/d"}}}
    env = {"LLM_SIDECAR_SETTLE_BATCH_MS": "60000", "LLM_SIDECAR_SETTLE_BATCH_MIN": "1"}
    with running_gateway(d, str(tmp_path_factory.mktemp("gw-settle-drain")), env=env) as gw:
        answer = client(gw, "drain").chat.completions.create(
            model="llama-2-13b", messages=MESSAGES, max_tokens=5)
        assert answer.usage is not None
        queued = metric(gw.extproc_metrics, "llm_sidecar_extproc_settlements_total")
        assert queued == 0 and settled(gw) == 0  # waiting in the queue
        assert gw.child("extproc").stop() == 0
        wait_until(lambda: settled(gw) >= 1, 10, 0.05)
