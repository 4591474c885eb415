"""extproc settles token reservations itself, batched (issue 16): the descriptors it builds are
exactly Envoy's stream-done ones, and the batcher sends them by time or size, counts failures,
and flushes on close."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry

from extproc.actions import Continue, Descriptor, Settlement
from extproc.adapters import rls_pb
from extproc.adapters.service import ExternalProcessor
from extproc.settlements import SettlementBatcher, settlement_for
from extproc.stream import StreamState
from extproc.telemetry.metrics import settlements_counter
from ratelimit import rls_pb as ratelimit_pb
from routing.compiled import listed_key_id
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.wire.names import (
    DONE_ENTRY,
    DONE_METADATA_KEY,
    LEASE_ENTRY,
    LEASE_METADATA_KEY,
    TOKENS_METADATA_KEY,
    USED_ENTRY,
)
from tests.extproc.helpers import JSON_POST, snapshot

SECRET = b"test-secret"
KEY = "sk-settle-0123456789abcdef"
KEY_ID = listed_key_id(hashlib.sha256(KEY.encode()).hexdigest())
API_KEYS = [{"name": "bot", "tenant": "acme", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]
ROUTE = (("x-llm-cluster", "vllm-short"), ("x-llm-model", "llama-2-13b"),
         ("x-llm-tenant", "acme"), ("x-llm-key-id", KEY_ID))
LEASE = "0123456789abcdef01234567"


def limits(**levels: dict[str, Any]) -> Any:
    return snapshot(api_keys=API_KEYS, rate_limits=levels)


def settle_entries(level: str, value: str, used: int) -> Descriptor:
    return (("kind", "tokens"), (level, value), (LEASE_ENTRY, LEASE), (USED_ENTRY, str(used)),
            (DONE_ENTRY, "1"))


@pytest.mark.parametrize(("levels", "expected"), [
    ({}, None),
    ({"tenant": {"default": {"requests": "10/s"}}}, None),  # no token limit: nothing to settle
    ({"tenant": {"default": {"concurrent": 2}}}, None),     # slots are Envoy's to release
    ({"tenant": {"default": {"tokens": "1k/min"}}}, (settle_entries("tenant", "acme", 17),)),
    ({"api_key": {"default": {"tokens": "1k/min"}}, "tenant": {"overrides": {"acme": {"tokens": "2k/min"}}},
      "model": {"default": {"tokens": "5k/min", "concurrent": 3}}},
     (settle_entries("api_key", KEY_ID, 17), settle_entries("tenant", "acme", 17),
      settle_entries("model", "llama-2-13b", 17))),
])
def test_the_descriptors_are_the_stream_done_ones_envoy_would_send(
        levels: dict[str, Any], expected: tuple[Descriptor, ...] | None) -> None:
    settlement = settlement_for(limits(**levels).config, ROUTE, LEASE, 17)
    assert (settlement.descriptors if settlement else None) == expected


def test_the_ratelimit_service_reads_a_batch_as_settles_of_each_lease() -> None:
    first = settlement_for(limits(tenant={"default": {"tokens": "1k/min"}}).config, ROUTE, LEASE, 17)
    second = settlement_for(limits(tenant={"default": {"tokens": "1k/min"}}).config,
                            ROUTE, "f" * 24, 0)
    assert first is not None and second is not None
    parsed = ratelimit_pb.request_from_proto(rls_pb2.RateLimitRequest.FromString(
        rls_pb.settle_payload(first.descriptors + second.descriptors)))
    assert parsed.domain == "llm-sidecar"
    assert [(d.phase, d.lease, d.used, d.entries) for d in parsed.descriptors] == [
        ("settle", LEASE, 17, (("kind", "tokens"), ("tenant", "acme"))),
        ("settle", "f" * 24, 0, (("kind", "tokens"), ("tenant", "acme"))),
    ]


def test_no_lease_no_settlement() -> None:
    assert settlement_for(limits(tenant={"default": {"tokens": "1k/min"}}).config, ROUTE, "", 5) is None


# --- through the stream: what a finished response answers --------------------------------

def run(snapshot_: Any, body: dict[str, Any], response: bytes, status: str = "200",
        content_type: str = "application/json",
        client_headers: dict[str, str] | None = None,
        path: str = "/v1/chat/completions") -> tuple[Continue, Continue]:
    """(the request-body answer, the answer that ends the response)."""
    state = StreamState(snapshot_, SECRET)
    state.handle("request_headers", {":path": path, **JSON_POST,
                                     "authorization": f"Bearer {KEY}", "x-request-id": "r1",
                                     **(client_headers or {})}, b"", False)
    routed = state.handle("request_body", None, orjson.dumps(body), True)
    headers = state.handle("response_headers", {":status": status, "content-type": content_type},
                           b"", False)
    assert isinstance(routed, Continue) and isinstance(headers, Continue)
    if headers.metadata or headers.settle is not None:
        return routed, headers
    end = state.handle("response_body", None, response, True)
    assert isinstance(end, Continue)
    return routed, end


CHAT = {"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = orjson.dumps({"choices": [{"message": {"content": "yo"}}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})


def test_a_non_streamed_answer_carries_its_settlement_under_its_own_lease() -> None:
    snap = limits(tenant={"default": {"tokens": "1k/min"}})
    routed, end = run(snap, CHAT, ANSWER)
    lease = routed.metadata[LEASE_METADATA_KEY]
    assert end.settle is not None
    (descriptor,) = end.settle.descriptors
    assert descriptor == (("kind", "tokens"), ("tenant", "acme"), (LEASE_ENTRY, lease),
                          (USED_ENTRY, "12"), (DONE_ENTRY, "1"))
    # Envoy's keys are still there: the service removes llm_done only if its batcher takes it.
    assert end.metadata[TOKENS_METADATA_KEY] == "12" and end.metadata[DONE_METADATA_KEY] == "1"


EMBED = {"model": "bge-m3", "input": ["a b c", "d e"]}
VECTORS = orjson.dumps({"object": "list", "model": "bge-m3",
                        "data": [{"object": "embedding", "index": i, "embedding": [0.5, 0.25]}
                                 for i in range(2)],
                        "usage": {"prompt_tokens": 7, "total_tokens": 7}})


@pytest.mark.parametrize(("status", "body", "used"), [
    ("200", VECTORS, "7"),                                 # vLLM's usage
    ("400", b'{"error": {"message": "too many dimensions"}}', "0"),  # refused: nothing kept
    ("503", b"upstream connect error", "0"),
])
def test_an_embeddings_answer_carries_its_settlement(status: str, body: bytes, used: str) -> None:
    snap = limits(tenant={"default": {"tokens": "1k/min"}})
    routed, end = run(snap, EMBED, body, status=status, path="/v1/embeddings")
    lease = routed.metadata[LEASE_METADATA_KEY]
    assert end.settle is not None
    (descriptor,) = end.settle.descriptors
    assert descriptor == (("kind", "tokens"), ("tenant", "acme"), (LEASE_ENTRY, lease),
                          (USED_ENTRY, used), (DONE_ENTRY, "1"))
    assert end.metadata[TOKENS_METADATA_KEY] == used


def test_a_client_cannot_name_the_levels_or_lease_it_is_settled_under() -> None:
    """Spoofed x-llm-* headers are removed before routing; the settlement holds extproc's own
    tenant and key id, and the lease extproc made (never a client value)."""
    snap = limits(tenant={"default": {"tokens": "1k/min"}}, api_key={"default": {"tokens": "1k/min"}})
    routed, end = run(snap, CHAT, ANSWER, client_headers={
        "x-llm-tenant": "victim", "x-llm-key-id": "victim-key", "x-llm-lease": LEASE,
        "llm_lease": LEASE})
    assert end.settle is not None
    levels = {d[1] for d in end.settle.descriptors}
    assert levels == {("api_key", KEY_ID), ("tenant", "acme")}
    leases = {dict(d)[LEASE_ENTRY] for d in end.settle.descriptors}
    assert leases == {routed.metadata[LEASE_METADATA_KEY]} and LEASE not in leases


def test_an_upstream_error_settles_zero() -> None:
    snap = limits(tenant={"default": {"tokens": "1k/min"}})
    _, end = run(snap, CHAT, b'{"error": {"message": "boom"}}', status="500")
    assert end.settle is not None and dict(end.settle.descriptors[0])[USED_ENTRY] == "0"


def test_an_unread_stream_that_errors_is_settled_zero_at_its_headers() -> None:
    snap = snapshot(api_keys=API_KEYS, rate_limits={"tenant": {"default": {"tokens": "1k/min"}}},
                    telemetry={"sample": 0, "envoy_usage": True})
    state = StreamState(snap, SECRET)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "authorization": f"Bearer {KEY}",
                                     "x-llm-envoy-usage": "1"}, b"", False)
    state.handle("request_body", None, orjson.dumps({**CHAT, "stream": True}), True)
    answer = state.handle("response_headers", {":status": "503"}, b"", False)
    assert isinstance(answer, Continue) and answer.settle is not None
    assert dict(answer.settle.descriptors[0])[USED_ENTRY] == "0"


def test_a_read_stream_whose_usage_envoy_reads_is_left_to_envoy() -> None:
    """The client asked for usage: Envoy's sse_to_metadata settles it, so extproc (reading it
    because it was sampled) must not settle it a second time."""
    snap = limits(tenant={"default": {"tokens": "1k/min"}})
    state = StreamState(snap, SECRET)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "authorization": f"Bearer {KEY}",
                                     "x-llm-envoy-usage": "1"}, b"", False)
    state.handle("request_body", None, orjson.dumps(
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}}), True)
    state.handle("response_headers", {":status": "200", "content-type": "text/event-stream"},
                 b"", False)
    end = state.handle("response_body", None,
                       b'data: {"choices":[],"usage":{"total_tokens":5}}\n\ndata: [DONE]\n\n', True)
    assert isinstance(end, Continue) and end.settle is None
    assert end.metadata[DONE_METADATA_KEY] == "1"


def test_a_read_stream_without_usage_for_envoy_is_settled_by_extproc() -> None:
    """No Envoy usage filters (no marker): extproc asked vLLM for the usage chunk, settles
    with it, and takes it out of what the client gets."""
    snap = limits(tenant={"default": {"tokens": "1k/min"}})
    state = StreamState(snap, SECRET)
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST,
                                     "authorization": f"Bearer {KEY}"}, b"", False)
    routed = state.handle("request_body", None, orjson.dumps({**CHAT, "stream": True}), True)
    assert isinstance(routed, Continue) and routed.body is not None
    assert orjson.loads(routed.body)["stream_options"] == {"include_usage": True}
    state.handle("response_headers", {":status": "200", "content-type": "text/event-stream"},
                 b"", False)
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12}}\n\n'
    end = state.handle("response_body", None, chunk * 3 + usage + b"data: [DONE]\n\n", True)
    assert isinstance(end, Continue) and end.settle is not None
    assert end.metadata[TOKENS_METADATA_KEY] == "12"
    assert end.body == chunk * 3 + b"data: [DONE]\n\n"


# --- the service: exactly one of extproc and Envoy settles ----------------------------------

class Taking:
    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.offered: list[Settlement] = []

    def offer(self, settlement: Settlement) -> bool:
        self.offered.append(settlement)
        return self.takes


@pytest.mark.parametrize("takes", [True, False])
def test_envoy_gets_llm_done_only_when_the_batcher_did_not_take_the_settlement(takes: bool) -> None:
    batcher = Taking(takes)
    servicer = ExternalProcessor(lambda: snapshot(), Settings(), settlements=batcher)  # type: ignore[arg-type]
    settlement = Settlement((settle_entries("tenant", "acme", 3),))
    step = Continue(metadata={TOKENS_METADATA_KEY: "3", DONE_METADATA_KEY: "1"}, settle=settlement)
    out = servicer._settled(step)
    assert batcher.offered == [settlement]
    # Neither key when taken: Envoy's SSE filter writes llm_done at a stream's end, and
    # llm_tokens with it would make Envoy settle a second time.
    assert (DONE_METADATA_KEY in out.metadata) is not takes
    assert (TOKENS_METADATA_KEY in out.metadata) is not takes


# --- the batcher -------------------------------------------------------------------------

class Service:
    """A fake rate-limit call: records each batch, answers ``ok`` (or raises)."""

    def __init__(self, ok: bool = True, raises: bool = False) -> None:
        self.ok = ok
        self.raises = raises
        self.batches: list[tuple[Descriptor, ...]] = []
        self.sent = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def send(self, batch: tuple[Descriptor, ...]) -> bool:
        self.batches.append(batch)
        self.sent.set()
        await self.release.wait()
        if self.raises:
            raise RuntimeError("bug")
        return self.ok


def one(n: int, size: int = 1) -> Settlement:
    return Settlement(tuple(settle_entries("tenant", f"t{n}-{i}", n) for i in range(size)))


def counted(batcher: SettlementBatcher, registry: CollectorRegistry, result: str) -> float:
    return registry.get_sample_value("llm_sidecar_extproc_settlements_total",
                                     {"result": result}) or 0.0


async def test_a_batch_is_sent_after_the_interval_in_one_call() -> None:
    service, registry = Service(), CollectorRegistry()
    batcher = SettlementBatcher(service.send, 0.005, settlements_counter(registry))
    assert all(batcher.offer(one(n)) for n in range(5))
    assert service.batches == []  # nothing leaves before the interval
    await asyncio.wait_for(service.sent.wait(), 10)
    assert service.batches == [tuple(one(n).descriptors[0] for n in range(5))]
    await batcher.aclose()
    assert counted(batcher, registry, "ok") == 5
    assert registry.get_sample_value("llm_sidecar_extproc_settlement_batches_total",
                                     {"result": "ok"}) == 1


async def test_a_full_batch_leaves_at_once_and_never_above_the_size() -> None:
    service, registry = Service(), CollectorRegistry()
    batcher = SettlementBatcher(service.send, 3600, settlements_counter(registry), max_descriptors=4)
    batcher.offer(one(1, size=3))
    batcher.offer(one(2, size=3))  # 6 queued: sent now, as 3 + 3 (a settlement is never split)
    await asyncio.wait_for(service.sent.wait(), 10)
    await asyncio.sleep(0)
    assert [len(b) for b in service.batches] == [3, 3]
    assert batcher.pending == 0
    await batcher.aclose()


async def test_close_sends_the_queue_and_waits_for_calls_in_flight() -> None:
    service, registry = Service(), CollectorRegistry()
    service.release.clear()
    batcher = SettlementBatcher(service.send, 3600, settlements_counter(registry))
    batcher.offer(one(1))
    closing = asyncio.ensure_future(batcher.aclose())
    await asyncio.wait_for(service.sent.wait(), 10)
    assert not closing.done()  # the call is in flight
    service.release.set()
    await asyncio.wait_for(closing, 10)
    assert counted(batcher, registry, "ok") == 1
    assert not batcher.offer(one(2))  # draining: Envoy settles what still ends
    assert counted(batcher, registry, "envoy") == 1
    await batcher.aclose()  # twice is fine


@pytest.mark.parametrize("raises", [False, True])
async def test_a_failed_batch_is_counted_and_not_retried(raises: bool) -> None:
    service, registry = Service(ok=False, raises=raises), CollectorRegistry()
    batcher = SettlementBatcher(service.send, 3600, settlements_counter(registry), max_descriptors=1)
    batcher.offer(one(1))
    batcher.offer(one(2))
    await batcher.aclose()
    assert len(service.batches) == 2  # each sent once
    assert counted(batcher, registry, "failed") == 2
    assert counted(batcher, registry, "ok") == 0


async def test_a_backlog_hands_settlements_back_to_envoy() -> None:
    service, registry = Service(), CollectorRegistry()
    service.release.clear()  # the service does not answer
    batcher = SettlementBatcher(service.send, 3600, settlements_counter(registry), max_descriptors=2,
                                max_pending=4)
    assert [batcher.offer(one(n)) for n in range(6)] == [True] * 4 + [False] * 2
    assert counted(batcher, registry, "envoy") == 2
    service.release.set()
    await batcher.aclose()
    assert counted(batcher, registry, "ok") == 4


async def test_an_interval_of_zero_leaves_every_settlement_to_envoy() -> None:
    service, registry = Service(), CollectorRegistry()
    batcher = SettlementBatcher(service.send, 0, settlements_counter(registry))
    assert not batcher.offer(one(1))
    await batcher.aclose()
    assert service.batches == []


async def test_a_lone_settlement_is_left_to_envoy_a_busy_interval_is_batched() -> None:
    """A batch of one costs extproc a call dearer than Envoy's: a new batch starts only after
    an interval that saw ``min_batch`` settlements; one under way takes every newcomer."""
    now = [0.0]
    service, registry = Service(), CollectorRegistry()
    batcher = SettlementBatcher(service.send, 3600, settlements_counter(registry), min_batch=3,
                                max_descriptors=3, clock=lambda: now[0])
    assert [batcher.offer(one(n)) for n in range(3)] == [False] * 3  # nothing seen before
    now[0] = 3600.5  # the next interval: the last one saw 3
    assert [batcher.offer(one(n)) for n in range(2)] == [True, True]
    now[0] = 7201  # the last interval saw 2, but a batch is under way: joined (and now full)
    assert batcher.offer(one(9))
    now[0] = 7202  # no batch under way, and the last interval saw 2: Envoy settles
    assert not batcher.offer(one(10))
    await batcher.aclose()
    assert [len(b) for b in service.batches] == [3]
    assert counted(batcher, registry, "envoy") == 4
    assert counted(batcher, registry, "ok") == 3
