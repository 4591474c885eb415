"""One ext_proc stream = one :class:`StreamState` (sans-IO: feed it messages, get actions back).

The processor is chosen from the path on the request-headers message; until then nothing is
known and a message out of order is passed through. Client errors become OpenAI-shaped replies
here, in one place; an unexpected exception becomes a 500 reply rather than a broken stream.
It reports nothing itself: what happened (a route chosen, a client error answered, a request
ended) rides on the answers it returns and on :meth:`StreamState.close`'s value, as
:mod:`extproc.records` values the service hands to telemetry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from extproc.actions import (
    PASS,
    Action,
    Continue,
    Found,
    Hold,
    Lookup,
    Phase,
    RateCheck,
    Reply,
    Step,
    Verdict,
    Waited,
    evolve,
)
from extproc.canary.policy import OPEN_CANARIES, PolicySource
from extproc.context import EndpointPicking, RequestContext, spoofed_headers
from extproc.errors import client_error_of, error_body, method_not_allowed, unknown_path
from extproc.identity import identify
from extproc.processors.base import Processor, body_required
from extproc.processors.embeddings import EmbeddingsProcessor
from extproc.processors.error import ErrorProcessor
from extproc.processors.generation import GenerationProcessor
from extproc.processors.models import ModelsProcessor
from extproc.records import Rejection, RequestRecord
from extproc.sampling import ReadFloor
from routing.compiled import Snapshot
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.wire.names import (
    BOOTSTRAP_HEADER,
    CLIENT_CREDENTIALS,
    CLUSTER_HEADER,
    CLUSTER_METADATA_KEY,
)

log = get_logger("extproc.stream")

_POST_ROUTES = {
    "/v1/chat/completions": lambda ctx: GenerationProcessor(ctx, "chat"),
    "/v1/completions": lambda ctx: GenerationProcessor(ctx, "completions"),
    "/v1/embeddings": EmbeddingsProcessor,
}
_GET_ROUTES = {"/v1/models": ModelsProcessor}



def routed(action: Step) -> Step:
    """``action`` with the pool it names in ``x-llm-cluster`` also given as dynamic metadata
    (Envoy's routes to a pool match only that: a client can send a header, never metadata), and
    without the client's credentials, which no pool gets (the rendered routes remove them too;
    this covers Istio, whose routes ``render`` does not write)."""
    if not isinstance(action, Continue):
        return action
    cluster = next((v for k, v in action.set_headers if k == CLUSTER_HEADER), None)
    if cluster is None:
        return action
    metadata = MappingProxyType({**action.metadata, CLUSTER_METADATA_KEY: cluster})
    return evolve(action, metadata=metadata,
                  remove_headers=(*action.remove_headers, *CLIENT_CREDENTIALS))


def choose_processor(ctx: RequestContext) -> Processor:
    path = ctx.path
    post: Callable[[RequestContext], Processor] | None = _POST_ROUTES.get(path)
    get: Callable[[RequestContext], Processor] | None = _GET_ROUTES.get(path)
    if ctx.method == "POST" and post is not None:
        return post(ctx)
    if ctx.method == "GET" and get is not None:
        return get(ctx)
    err = method_not_allowed(ctx.method, path) if (post or get) else unknown_path(ctx.method, path)
    return ErrorProcessor(ctx, Reply(err.status, err.body()))


class StreamState:
    """Holds what one HTTP request's ext_proc stream has seen so far."""

    def __init__(self, snapshot: Snapshot, key_id_secret: bytes,
                 clock: Callable[[], float] = time.monotonic,
                 guards: PolicySource | None = None,
                 picker: EndpointPicking | None = None,
                 on_stale: Callable[[str, str], None] | None = None,
                 read_floor: ReadFloor | None = None) -> None:
        self.snapshot = snapshot
        self.read_floor = read_floor
        self.on_stale = on_stale
        """Told (Envoy's fingerprint, the config's) when this request's Envoy runs a bootstrap
        the running config does not render (:mod:`extproc.telemetry.envoy_drift`)."""
        self.guards = guards
        self.picker = picker
        self.secret = key_id_secret
        self.clock = clock
        self.processor: Processor | None = None
        self.ctx: RequestContext | None = None
        self.body_seen = False

    def handle(self, phase: Phase, headers: Mapping[str, str] | None, body: bytes,
               end_of_stream: bool) -> Step:
        """The answer to one message (or a :class:`Lookup` to do first); never raises."""
        try:
            return self._dispatch(phase, headers, body, end_of_stream)
        except Exception as exc:
            return self._failed(exc, phase)

    def resume(self, lookup: Lookup, found: Found) -> Step:
        """The next step of the message that asked for ``lookup``, given what it found."""
        try:
            return routed(lookup.resume(found))
        except Exception as exc:
            return self._failed(exc, "request_body")

    def held(self, hold: Hold, waited: Waited) -> Step:
        """The next step of the request that waited (``hold``), given how its wait ended."""
        try:
            return routed(hold.resume(waited))
        except Exception as exc:
            return self._failed(exc, "request_body")

    def admit(self, check: RateCheck, verdict: Verdict) -> Action:
        """The answer to the message that asked for ``check``, given the rate limiter's verdict."""
        try:
            return check.resume(verdict)
        except Exception as exc:
            return self._failed(exc, "request_body")

    def close(self) -> RequestRecord | None:
        """The stream is over, however it ended; never raises, and safe to call twice.

        After a normal end an answer carried the request's record already, and this returns
        None; after a reset (client gone, upstream reset) it returns the request's record as
        aborted, once.
        """
        processor = self.processor
        if processor is None:
            return None
        try:
            return processor.on_close()
        except Exception:
            log.exception("extproc_internal_error", phase="close",
                          request_id=self.ctx.request_id if self.ctx else None)
            return None

    def _failed(self, exc: Exception, phase: Phase) -> Reply:
        client = client_error_of(exc)
        if client is not None:
            return Reply(client.status, client.body(),
                         headers=(("content-type", "application/json"), *client.headers),
                         details=client.code, rejection=Rejection(client.status, client.code))
        log.exception("extproc_internal_error", phase=phase,  # called inside an except block
                      request_id=self.ctx.request_id if self.ctx else None)
        return Reply(500, error_body("The gateway failed to process the request.",
                                     "server_error", "internal_error"),
                     details="internal_error")

    def _dispatch(self, phase: Phase, headers: Mapping[str, str] | None, body: bytes,
                  end_of_stream: bool) -> Step:
        if phase == "request_headers":
            return self._start(headers or {}, end_of_stream)
        processor = self.processor
        if processor is None:
            return PASS
        if phase == "request_body":
            self.body_seen = True
            return routed(processor.on_request_body(body))
        if phase == "request_trailers":
            # HTTP/2 (or chunked HTTP/1.1) headers then trailers, no body: every processor
            # that let the headers through needs the body, so this is decided here, not left
            # to go on undecided (Envoy sends no body message when there was none).
            return PASS if self.body_seen else body_required()
        if phase == "response_headers":
            return processor.on_response_headers(dict(headers or {}), end_of_stream)
        return processor.on_response_body(body, end_of_stream)

    def _start(self, headers: Mapping[str, str], end_of_stream: bool) -> Action:
        removed = spoofed_headers(headers)
        # Read nothing a client could have spoofed: drop x-llm-* before deciding anything.
        clean = {k: v for k, v in headers.items() if k not in removed} if removed else headers
        if self.on_stale is not None:
            seen = clean.get(BOOTSTRAP_HEADER)
            if seen is not None and seen != self.snapshot.envoy_fingerprint:
                self.on_stale(seen, self.snapshot.envoy_fingerprint)
        raw_path = clean.get(":path", "/")
        path, query, _ = raw_path.partition("?")
        ctx = RequestContext(
            snapshot=self.snapshot,
            method=clean.get(":method", "GET").upper(),
            path=path,
            headers=clean,
            identity=identify(self.snapshot, clean, self.secret),
            request_id=clean.get("x-request-id", ""),
            started=self.clock(),
            clock=self.clock,
            picker=self.picker,
            read_floor=self.read_floor,
            # Read once: the request routes by the canaries in force when it started.
            canaries=self.guards.policy if self.guards is not None else OPEN_CANARIES,
        )
        self.ctx = ctx
        self.processor = choose_processor(ctx)
        action = self.processor.on_request_headers(end_of_stream)
        if removed and isinstance(action, Continue):
            action = evolve(action, remove_headers=action.remove_headers + removed)
        if query and isinstance(action, Continue):
            # No endpoint reads a query, and a client may have put its key there
            # (?key=sk-...): vLLM's access log would keep it. The pool gets the bare path.
            action = evolve(action, set_headers=((":path", path), *action.set_headers))
        return action
