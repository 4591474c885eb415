"""The processors' transition tables: every allowed transition, and every other one refused.

The expected tables are written out here, apart from the code's, so a change to either is a
change someone meant. Then the stream fed messages its processor's phase does not expect: a
logged internal error and a 500 answer, never an exception out of the stream.
"""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, get_args

import orjson
import pytest
from structlog.testing import capture_logs

from extproc.actions import Continue, Reply
from extproc.processors.phases import (
    EMBEDDINGS,
    GENERATION,
    Admitting,
    AwaitingBody,
    Buffering,
    Done,
    Event,
    Forwarded,
    Looking,
    Reading,
    Routed,
    Table,
    TransitionError,
    advance,
)
from extproc.stream import StreamState
from tests.extproc.helpers import JSON_POST, snapshot
from tests.extproc.served import Recorder, Served

GENERATION_ALLOWED = {
    (AwaitingBody, "request_body", Routed),
    (AwaitingBody, "response_headers", Done),  # Envoy's own answer (its 413) before the body
    (AwaitingBody, "close", Done),
    (Routed, "response_headers", Reading),   # a response extproc reads
    (Routed, "response_headers", Done),      # recorded at its headers (not read, or no body)
    (Routed, "response_body", Reading),      # a body with no headers seen: status 0
    (Routed, "response_body", Done),
    (Routed, "close", Done),                 # aborted before the response
    (Reading, "response_body", Reading),
    (Reading, "response_body", Done),        # end of stream, or ``[DONE]``
    (Reading, "close", Done),                # aborted mid-response
    (Done, "response_body", Done),           # chunks after ``[DONE]`` pass
    (Done, "close", Done),                   # close is safe twice
}
EMBEDDINGS_ALLOWED = {
    (AwaitingBody, "request_body", Looking),     # a model with a cache
    (AwaitingBody, "request_body", Forwarded),   # a model without one
    (AwaitingBody, "response_headers", Done),    # Envoy's own answer before the body
    (AwaitingBody, "close", Done),
    (Looking, "lookup", Admitting),              # every input cached
    (Looking, "lookup", Forwarded),              # partial, miss or bypass
    (Looking, "close", Done),
    (Admitting, "admitted", Done),
    (Admitting, "close", Done),
    (Forwarded, "response_headers", Buffering),  # a 200 to read
    (Forwarded, "response_headers", Done),       # an error, or no body
    (Forwarded, "close", Done),
    (Buffering, "response_body", Buffering),
    (Buffering, "response_body", Done),
    (Buffering, "close", Done),
    (Done, "response_body", Done),
    (Done, "close", Done),
}
EVENTS: tuple[Event, ...] = get_args(Event)


def sample(kind: type) -> Any:
    """A phase of type ``kind``: the table reads only its type, so its fields are blanks."""
    return kind(*[None for f in fields(kind) if f.init])


def listed(table: Table) -> set[tuple[type, str, type]]:
    return {(before, event, after) for before, events in table.items()
            for event, afters in events.items() for after in afters}


@pytest.mark.parametrize(("table", "allowed"), [(GENERATION, GENERATION_ALLOWED),
                                                (EMBEDDINGS, EMBEDDINGS_ALLOWED)],
                         ids=["generation", "embeddings"])
def test_the_table_is_the_written_one(table: Table, allowed: set[tuple[type, str, type]]) -> None:
    assert listed(table) == allowed


@pytest.mark.parametrize(("before", "event", "after"),
                         sorted(GENERATION_ALLOWED, key=repr), ids=repr)
def test_every_generation_transition_is_allowed(before: type, event: Event, after: type) -> None:
    new = sample(after)
    assert advance(GENERATION, sample(before), event, new) is new


@pytest.mark.parametrize(("before", "event", "after"),
                         sorted(EMBEDDINGS_ALLOWED, key=repr), ids=repr)
def test_every_embeddings_transition_is_allowed(before: type, event: Event, after: type) -> None:
    new = sample(after)
    assert advance(EMBEDDINGS, sample(before), event, new) is new


@pytest.mark.parametrize(("table", "allowed"), [(GENERATION, GENERATION_ALLOWED),
                                                (EMBEDDINGS, EMBEDDINGS_ALLOWED)],
                         ids=["generation", "embeddings"])
def test_every_other_transition_is_refused(table: Table,
                                           allowed: set[tuple[type, str, type]]) -> None:
    kinds = set(table)
    refused = 0
    for before, event, after in itertools.product(kinds, EVENTS, kinds):
        if (before, event, after) in allowed:
            continue
        with pytest.raises(TransitionError, match="is not a transition"):
            advance(table, sample(before), event, sample(after))
        refused += 1
    assert refused == len(kinds) ** 2 * len(EVENTS) - len(allowed)


@pytest.mark.parametrize(("table", "before", "event", "after"), [
    (GENERATION, Done, "response_headers", Reading),   # a second response
    (GENERATION, AwaitingBody, "response_body", Done),  # a response before any routing
    (GENERATION, Reading, "request_body", Routed),      # routed twice
    (EMBEDDINGS, Forwarded, "lookup", Forwarded),        # a lookup nobody asked for
    (EMBEDDINGS, Looking, "admitted", Done),             # admitted without being a hit
    (EMBEDDINGS, Done, "response_headers", Buffering),
    (EMBEDDINGS, Reading, "close", Done),                # a phase of the other processor
])
def test_a_few_refused_transitions_say_what_was_asked(table: Table, before: type, event: Event,
                                                     after: type) -> None:
    with pytest.raises(TransitionError) as refused:
        advance(table, sample(before), event, sample(after))
    assert str(refused.value) == (f"{before.__name__} --{event}--> {after.__name__} "
                                  "is not a transition")


CHAT = orjson.dumps({"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}]})
EMBED = orjson.dumps({"model": "bge-m3", "input": ["a", "b"]})


def started(path: str, telemetry: Recorder) -> Served:
    state = Served(StreamState(snapshot(), b"s"), telemetry)
    assert isinstance(state.handle("request_headers", {":path": path, **JSON_POST,
                                                       "x-request-id": "r1"}, b"", False),
                      Continue)
    return state


@pytest.mark.parametrize(("path", "messages"), [
    # A response body before the request was routed (response headers then are Envoy's own
    # answer: test_envoys_own_answer_before_the_body_passes).
    ("/v1/chat/completions", [("response_body", None, b"data: [DONE]\n\n")]),
    ("/v1/embeddings", [("response_body", None, b"{}")]),
    # A second request body (Envoy buffers the body: there is only ever one).
    ("/v1/chat/completions", [("request_body", None, CHAT), ("request_body", None, CHAT)]),
    ("/v1/embeddings", [("request_body", None, EMBED), ("request_body", None, EMBED)]),
    # Response body chunks with no response headers seen (an embeddings answer is only read
    # once its 200 is known).
    ("/v1/embeddings", [("request_body", None, EMBED), ("response_body", None, b"{}")]),
    # A second response after the first ended.
    ("/v1/chat/completions", [("request_body", None, CHAT),
                              ("response_headers", {":status": "200"}, b""),
                              ("response_body", None, b"{}"),
                              ("response_headers", {":status": "200"}, b"")]),
])
def test_an_unexpected_message_is_a_logged_internal_error(
        path: str, messages: list[tuple[Any, dict[str, str] | None, bytes]]) -> None:
    telemetry = Recorder()
    state = started(path, telemetry)
    with capture_logs() as logs:
        answers = [state.handle(phase, headers, body, phase == "request_body" or body == b"{}")
                   for phase, headers, body in messages]
    last = answers[-1]
    assert isinstance(last, Reply) and last.status == 500
    assert orjson.loads(last.body)["error"]["code"] == "internal_error"
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["extproc_internal_error"]
    state.close()  # the stream still ends cleanly, and records a routed request once at most
    state.close()
    assert len(telemetry.records) <= 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_envoys_own_answer_before_the_body_passes(path: str) -> None:
    """A body above Envoy's buffer limit gets Envoy's own 413 while extproc waits for the body;
    when extproc had already asked for response headers, they come to it in AwaitingBody. The
    413 passes as Envoy wrote it (it used to become a 500), nothing is read or recorded."""
    telemetry = Recorder()
    state = started(path, telemetry)
    with capture_logs() as logs:
        answer = state.handle("response_headers", {":status": "413",
                                                   "content-type": "application/json"},
                              b"", False)
        assert isinstance(answer, Continue)
        assert answer.set_headers == () and answer.body is None
        assert answer.mode is not None and answer.mode.response_body == "none"
        assert state.handle("response_body", None, b'{"error": {}}', True) == Continue()
    assert [e for e in logs if e["log_level"] == "error"] == []
    state.close()
    assert telemetry.records == []


def test_done_is_final_whatever_comes_after() -> None:
    """Close after close, and chunks after the end: passed, the request recorded once."""
    telemetry = Recorder()
    state = started("/v1/chat/completions", telemetry)
    state.handle("request_body", None, CHAT, True)
    state.handle("response_headers", {":status": "200", "content-type": "text/event-stream"},
                 b"", False)
    end = state.handle("response_body", None,
                       b'data: {"choices":[],"usage":{"total_tokens":5}}\n\ndata: [DONE]\n\n',
                       False)
    assert isinstance(end, Continue) and end.metadata["llm_done"] == "1"  # settled at [DONE]
    assert state.handle("response_body", None, b"late", True) == Continue()
    state.close()
    state.close()
    assert [r.aborted for r in telemetry.records] == [False]
