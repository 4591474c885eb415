"""Drive one ext_proc stream end to end on protobuf messages (as the gRPC servicer does, minus
the network) and check every answer is a valid ProcessingResponse: a pass-through, a mutation,
or an OpenAI-shaped 4xx. A 5xx would mean an exception escaped the request logic."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.actions import Continue, Found, Hold, Lookup, Reply, Verdict, Waited
from extproc.adapters import ext_proc_pb
from extproc.stream import StreamState
from routing.compiled import Snapshot
from tests.extproc.helpers import snapshot

SECRET = b"fuzz-secret"
LISTED_KEY = "sk-fuzz-listed"
FORBIDDEN_IN_HEADERS = ("\r", "\n", "\x00")


def rich_snapshot() -> Snapshot:
    """Every feature on, so the fuzzer reaches every branch: keys, auth, limits, canary,
    priority injection, the embedding cache."""
    return snapshot(
        clusters={
            "vllm-short": {"endpoints": ["10.0.0.11:8000"], "max_context": 2048},
            "vllm-long": {"endpoints": ["10.0.0.12:8000"], "max_context": 32768},
            "vllm-canary": {"endpoints": ["10.0.0.13:8000"], "max_context": 32768},
            "embed": {"endpoints": ["10.0.0.14:8000"], "max_context": 8192},
        },
        models={
            "llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "default_max_tokens": 256,
                            "canary": {"model": "llama-2-13b-v2", "cluster": "vllm-canary",
                                       "percent": 50, "sticky": "request"}},
            "bge-m3": {"kind": "embedding", "clusters": ["embed"],
                       "cache": {"namespace": "bge-m3", "ttl": "1h"}},
        },
        api_keys=[{"name": "fuzz-bot", "tenant": "fuzz",
                   "sha256": hashlib.sha256(LISTED_KEY.encode()).hexdigest()}],
        rate_limits={"api_key": {"default": {"requests": "10/s", "tokens": "1k/min"}},
                     "tenant": {"overrides": {"fuzz": {"requests": "5/s"}}}},
        priority={"high_below": 500, "low_from": 5000, "inject": True},
    )


def headers_message(phase: str, headers: Mapping[str, str], end: bool) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    message = getattr(request, phase)
    for key, value in headers.items():
        header = message.headers.headers.add()
        header.key = key
        header.raw_value = value.encode("utf-8", "surrogatepass")
    message.end_of_stream = end
    return request


def body_message(phase: str, body: bytes, end: bool) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    message = getattr(request, phase)
    message.body = body
    message.end_of_stream = end
    return request


@dataclass
class Answer:
    phase: str
    response: pb.ProcessingResponse
    seconds: float

    @property
    def status(self) -> int | None:
        if self.response.WhichOneof("response") == "immediate_response":
            return int(self.response.immediate_response.status.code)
        return None


def check(answer: Answer) -> None:
    """The properties every answer must have."""
    response = answer.response
    kind = response.WhichOneof("response")
    assert kind is not None, "an empty ProcessingResponse"
    again = pb.ProcessingResponse.FromString(response.SerializeToString())
    assert again == response
    mutations: list[base_pb2.HeaderValueOption] = []
    if kind == "immediate_response":
        immediate = response.immediate_response
        status = immediate.status.code
        assert 200 <= status < 500, f"status {status}: {immediate.body[:300]!r}"
        mutations.extend(immediate.headers.set_headers)
        if status >= 400:
            error = orjson.loads(immediate.body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert isinstance(error["message"], str) and isinstance(error["code"], str)
    else:
        assert kind == answer.phase, (kind, answer.phase)
        mutations.extend(getattr(response, kind).response.header_mutation.set_headers)
    for option in mutations:
        value = option.header.raw_value.decode("utf-8") or option.header.value
        for bad in FORBIDDEN_IN_HEADERS:
            assert bad not in option.header.key and bad not in value, (option.header.key, value)


def run_stream(headers: Mapping[str, str], body: bytes | None,
               response_chunks: Sequence[bytes] = (), found: Found = None,
               snap: Snapshot | None = None) -> list[Answer]:
    """Request headers, the body (if any), then, if the request was let through, response
    headers and ``response_chunks``. ``found`` answers any cache lookup."""
    state = StreamState(snap or rich_snapshot(), SECRET)
    messages = [headers_message("request_headers", headers, body is None)]
    if body is not None:
        messages.append(body_message("request_body", body, True))
    answers: list[Answer] = []

    def feed(request: pb.ProcessingRequest) -> Answer:
        started = time.perf_counter()
        phase, hdrs, raw, end = ext_proc_pb.read(request)
        assert phase is not None
        step = state.handle(phase, hdrs, raw, end)
        # Do what the service does between messages: fetch a lookup's values, and ask the
        # limiter about a reply extproc makes itself (here it always admits).
        while not isinstance(step, Continue | Reply):
            if isinstance(step, Lookup):
                step = state.resume(step, found if found is None else
                                    tuple(found[i % len(found)] if found else None
                                          for i in range(len(step.keys))))
            elif isinstance(step, Hold):  # released at once, to what it picks then
                step = state.held(step, Waited(step.pick(), 0.0))
            else:
                step = state.admit(step, Verdict("ok"))
        answer = Answer(phase, ext_proc_pb.build(phase, step), time.perf_counter() - started)
        check(answer)
        answers.append(answer)
        return answer

    for message in messages:
        if feed(message).status is not None:
            return answers
    feed(headers_message("response_headers", {":status": "200",
                                              "content-type": "text/event-stream"}, False))
    for n, chunk in enumerate(response_chunks):
        feed(body_message("response_body", chunk, n == len(response_chunks) - 1))
    return answers
