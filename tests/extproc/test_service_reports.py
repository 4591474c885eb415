"""The service is where telemetry hears about a request: ``ExternalProcessor.Process`` fed
ext_proc messages as Envoy sends them (no network), its telemetry a recorder.

The stream state and processors return what happened; these tests hold the service to
emitting it: the route and the record once, the aborted record when the stream is reset, a
phase timing per message, and an answer that a faulty telemetry cannot change.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import cast

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from structlog.testing import capture_logs

from extproc.adapters.service import ExternalProcessor
from extproc.records import Rejection, RequestRecord, RouteChosen
from sidecar_runtime.process.settings import Settings
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder
from tests.fuzz.driver import body_message, headers_message

CHAT = orjson.dumps({"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}],
                     "stream": True})
HEADERS = {":path": "/v1/chat/completions", **JSON_POST, "x-request-id": "r1"}
SSE = {":status": "200", "content-type": "text/event-stream"}
TOKEN = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'


class Timed(Recorder):
    """A recorder that also keeps the phase of each timing."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = []

    def phase(self, phase: str, seconds: float) -> None:
        assert seconds >= 0
        self.phases.append(phase)


class Broken(Timed):
    """Telemetry with a bug in every report (phase timings still work)."""

    def request_done(self, record: RequestRecord) -> None:
        raise RuntimeError("telemetry bug")

    def routed(self, model: str, cluster: str, variant: str) -> None:
        raise RuntimeError("telemetry bug")


def messages(*tail: pb.ProcessingRequest) -> list[pb.ProcessingRequest]:
    return [headers_message("request_headers", HEADERS, False),
            body_message("request_body", CHAT, True), *tail]


async def feed(requests: Sequence[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    for request in requests:
        yield request


async def process(telemetry: Timed, requests: Sequence[pb.ProcessingRequest]
                  ) -> list[pb.ProcessingResponse]:
    """Every answer to ``requests``; then the stream is reset, as Envoy resets it (at the
    answer to the last message, before the service's linger: that reset ends a normal stream
    and aborts one whose response was still coming)."""
    snap = snapshot()
    service = ExternalProcessor(lambda: snap, Settings(), telemetry)
    answers = cast(AsyncGenerator[pb.ProcessingResponse, None],
                   service.Process(feed(requests), None))  # type: ignore[arg-type]
    received = [await answers.__anext__() for _ in requests]
    await answers.aclose()
    return received


async def test_a_finished_request_is_routed_and_recorded_once_with_a_timing_per_message() -> None:
    telemetry = Timed()
    answers = await process(telemetry, messages(
        headers_message("response_headers", SSE, False),
        body_message("response_body", TOKEN, False),
        body_message("response_body", b"data: [DONE]\n\n", False)))
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "request_body", "response_headers", "response_body", "response_body"]
    assert telemetry.routes == [RouteChosen("llama-2-13b", "vllm-short", "stable")]
    (record,) = telemetry.records  # the reset after the last answer adds no second record
    assert not record.aborted and record.request_id == "r1" and record.completion_tokens == 1
    assert telemetry.phases == ["request_headers", "request_body", "response_headers",
                                "response_body", "response_body"]
    assert telemetry.rejections == []


async def test_a_stream_reset_mid_response_is_recorded_as_aborted() -> None:
    telemetry = Timed()
    await process(telemetry, messages(headers_message("response_headers", SSE, False),
                                      body_message("response_body", TOKEN, False)))
    (record,) = telemetry.records
    assert record.aborted and record.completion_tokens == 1 and record.charged_tokens is None


async def test_a_client_error_is_a_rejection_and_no_record() -> None:
    telemetry = Timed()
    (_, answer) = await process(telemetry, [headers_message("request_headers", HEADERS, False),
                                            body_message("request_body", b"{nope", True)])
    assert answer.immediate_response.status.code == 400
    assert telemetry.rejections == [Rejection(400, "invalid_json")]
    assert telemetry.records == [] and telemetry.routes == []


async def test_a_fault_in_telemetry_changes_no_answer_and_is_logged() -> None:
    async def answers(telemetry: Timed, *tail: pb.ProcessingRequest) -> list[bytes]:
        sent = await process(telemetry, messages(*tail))
        # Each request gets its own random lease id: the one part two answers may differ in.
        del sent[1].dynamic_metadata.fields["llm_sidecar"].struct_value.fields["llm_lease"]
        return [answer.SerializeToString() for answer in sent]

    ended = (headers_message("response_headers", SSE, False),
             body_message("response_body", b"data: [DONE]\n\n", False))
    with capture_logs() as logs:
        broken = await answers(Broken(), *ended)
        aborted = await answers(Broken(), ended[0])  # the aborted record's report fails too
    assert broken == await answers(Timed(), *ended)
    assert aborted == await answers(Timed(), ended[0])
    faults = [(e["event"], e["phase"], e["where"]) for e in logs if e["log_level"] == "error"]
    assert faults == [("extproc_internal_error", "request_body", "telemetry"),
                      ("extproc_internal_error", "response_body", "telemetry"),
                      ("extproc_internal_error", "request_body", "telemetry"),
                      ("extproc_internal_error", "close", "telemetry")]
