"""``/v1/embeddings``: routed by its longest input, answered from the embedding cache when it can be.

For a model with ``cache:`` the request body step returns a :class:`Lookup` of its inputs' keys;
with the values (see :mod:`extproc.cache.merge`):

* all cached (``hit``): a 200 ImmediateResponse. vLLM is never called. Envoy's rate-limit
  filter (after ext_proc in the chain) never sees the request, so extproc asks the rate-limit
  service itself first (:mod:`extproc.hit_limits`): a hit costs 1 from each request bucket and
  no tokens, and is refused with the same 429 a miss would get.
* none cached (``miss``): routed unchanged; the response is copied as it streams past and its
  vectors are stored.
* some cached (``partial``): the body asks only for the missing inputs; the response is held back
  chunk by chunk and replaced, at its end, by the answer merged in input order.
* the store cannot answer in time (``bypass``): routed unchanged, nothing stored.

The response body is STREAMED through extproc, never BUFFERED by Envoy: Envoy answers a bare 500
(``response_payload_too_large``) when a buffered body outgrows its per-connection buffer limit
(8 MiB here), which a 2,048-input batch does. Streamed, extproc holds the body instead (up to
:data:`MAX_RESPONSE_BYTES`), and Envoy drops ``content-length`` itself (chunked to HTTP/1.1
clients), so a merged body of another length needs no header fix-up.

Every embeddings response that reaches vLLM is read to charge its ``usage`` tokens (docs: Rate limits);
the request-body answer that sends it upstream carries its reservation (the counted tokens of
the inputs that go upstream) as dynamic metadata. Every request that got past the body step is
recorded once (:class:`extproc.records.RequestRecord`), as aborted when its stream ends first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from extproc.actions import (
    PASS,
    Action,
    CacheWrite,
    Continue,
    Found,
    Headers,
    Lookup,
    ModeOverride,
    Reply,
    Settlement,
    Step,
    Verdict,
)
from extproc.admission import admission_metadata, new_lease, usage_metadata
from extproc.bodies import parse_embeddings
from extproc.cache.keys import namespace_for, plan_keys, request_salt
from extproc.cache.merge import (
    MergeError,
    entries_to_store,
    hit_body,
    merged_body,
    missing_body,
    parse_response,
    resolve,
    upstream_vectors,
    usage_tokens,
)
from extproc.context import RequestContext
from extproc.errors import error_body
from extproc.hit_limits import answer, hit_check
from extproc.processors.base import (
    BaseProcessor,
    body_refused,
    decide_for,
    envoys_own_answer,
    resolve_model,
    route_headers,
)
from extproc.processors.phases import (
    AWAITING_BODY,
    DONE,
    EMBEDDINGS,
    Admitting,
    AwaitingBody,
    Buffering,
    CacheResult,
    Done,
    EmbeddingsPhase,
    Event,
    Forwarded,
    Looking,
    Parsed,
    ResponseBuffer,
    advance,
    refuse,
)
from extproc.records import RequestRecord, RouteChosen
from extproc.settlements import settlement_for
from extproc.tokens import counter_for
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.wire.names import CACHE_HEADER

log = get_logger("extproc.processors.embeddings")

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest vLLM answer held to merge or store (the gRPC message limit of extproc, too)."""

_STREAM_RESPONSE = ModeOverride(response_headers=True, response_body="streamed")
_SKIP_RESPONSE_BODY = ModeOverride(response_headers=False, response_body="none")
_HOLD = Continue(body=b"")
"""A chunk of a response that will be replaced: nothing of it reaches the client yet."""


class EmbeddingsProcessor(BaseProcessor):
    """``/v1/embeddings``, with the embedding cache for models that have ``cache:``.

    Its state is one phase of :data:`extproc.processors.phases.EMBEDDINGS`."""

    def __init__(self, ctx: RequestContext) -> None:
        super().__init__(ctx)
        self.phase: EmbeddingsPhase = AWAITING_BODY

    def _go(self, event: Event, new: EmbeddingsPhase) -> None:
        self.phase = advance(EMBEDDINGS, self.phase, event, new)

    def on_request_headers(self, end_of_stream: bool) -> Action:
        refused = body_refused(self.ctx, end_of_stream)
        if refused is not None:
            return refused
        # Whether the model is cached is only known from the body, and Envoy honours a mode
        # override only on a headers answer: ask for the response now, skip its body later.
        return Continue(mode=_STREAM_RESPONSE)

    def on_request_body(self, body: bytes) -> Step:
        if not isinstance(self.phase, AwaitingBody):
            raise refuse(self.phase, "request_body")
        parsed = parse_embeddings(body)
        model = resolve_model(self.ctx, parsed.model, "embedding")
        counter = counter_for(model.tokenizer)
        counts = [counter.count(item) if isinstance(item, str) else len(item)
                  for item in parsed.inputs]
        decision = decide_for(self.ctx, model, max(counts), 0)
        request = Parsed(parsed, model, decision, tuple(counts))
        policy = model.cache
        if policy is None:
            return self._forward("request_body", Forwarded(request, None, sum(counts)), None)
        namespace = namespace_for(policy, decision.variant, decision.upstream_model,
                                  self.ctx.identity.tenant)
        salt = request_salt(parsed.dimensions, parsed.encoding_format, parsed.doc)
        plan = plan_keys(namespace, salt, parsed.inputs)
        self._go("request_body", Looking(request, plan, policy))
        return Lookup(plan.distinct, self.on_lookup)

    def on_lookup(self, found: Found) -> Step:
        """The next step of the request body, once the cache has answered the lookup."""
        looking = self.phase
        if not isinstance(looking, Looking):
            raise refuse(looking, "lookup")
        request, plan = looking.parsed, looking.plan
        if found is None:
            return self._forward("lookup", Forwarded(request, "bypass", sum(request.counts)),
                                 None)
        resolution = resolve(plan, found)
        if resolution.outcome == "hit":
            self._go("lookup", Admitting(request, resolution))
            check = hit_check(self.ctx.snapshot,
                              route_headers(self.ctx, request.model, request.decision),
                              self.on_admitted)
            return self.on_admitted(Verdict("ok")) if check is None else check
        if resolution.outcome == "miss":
            return self._forward("lookup", Forwarded(request, "miss", sum(request.counts),
                                                     plan.keys, resolution, looking.policy),
                                 None)
        per_key = dict(zip(plan.keys, request.counts, strict=True))
        reserved = sum(per_key[key] for key in resolution.missing)
        forwarded = Forwarded(request, "partial", reserved, resolution.missing, resolution,
                              looking.policy)
        return self._forward("lookup", forwarded,
                             missing_body(_upstream_doc(request), resolution))

    def on_admitted(self, verdict: Verdict) -> Reply:
        """A hit's answer once the rate limiter has judged it: as Envoy's filter would have."""
        admitting = self.phase
        if not isinstance(admitting, Admitting):
            raise refuse(admitting, "admitted")
        request, resolution = admitting.parsed, admitting.resolution
        request_id = self.ctx.request_id or "local"
        hit = Reply(200, hit_body(resolution, request.decision.upstream_model,
                                  f"embd-cache-{request_id}"),
                    headers=(("content-type", "application/json"), (CACHE_HEADER, "hit")))
        reply = answer(verdict, hit, self.ctx.snapshot.config.services.ratelimit_failure_mode_deny)
        self._go("admitted", DONE)
        return replace(reply, record=self._record(request, "hit", reply.status, charged=0,
                                                  prompt_tokens=0))

    def _forward(self, event: Event, forwarded: Forwarded, body: bytes | None) -> Action:
        """Route the request upstream, its body replaced by ``body`` (else by a canary rename)."""
        request = forwarded.parsed
        decision = request.decision
        route = route_headers(self.ctx, request.model, decision)
        forwarded = replace(forwarded, lease=new_lease(), route=route)
        self._go(event, forwarded)
        if body is None and decision.upstream_model != request.body.model:
            body = orjson.dumps(_upstream_doc(request))
        headers: Headers = route
        if body is not None:
            headers += (("content-length", str(len(body))),)
        # The answer is read (usage, vectors, merge): ask for it uncompressed.
        return Continue(set_headers=headers, remove_headers=("accept-encoding",), body=body,
                        clear_route_cache=True,
                        metadata=admission_metadata(self.ctx.snapshot.config, dict(route),
                                                    forwarded.reserved, forwarded.lease),
                        route=RouteChosen(request.model.name, decision.cluster, decision.variant))

    def on_response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action:
        forwarded = self.phase
        if not isinstance(forwarded, Forwarded):
            if isinstance(forwarded, AwaitingBody):
                self._go("response_headers", DONE)
                return envoys_own_answer()
            raise refuse(forwarded, "response_headers")
        status = headers.get(":status", "")
        code = int(status) if status.isdigit() else 0
        outcome = forwarded.outcome
        cache: Headers = ((CACHE_HEADER, outcome),) if outcome is not None else ()
        if status != "200" or end_of_stream:
            # An error (or nothing) from upstream is passed on as it is: nothing to store,
            # nothing to merge, and no tokens computed: the reservation settles to 0, as a
            # chat error's does (it used to stand, charged, while the record said 0).
            self._go("response_headers", DONE)
            record = self._record(forwarded.parsed, outcome, code, charged=0,
                                  prompt_tokens=forwarded.reserved)
            return Continue(set_headers=cache, mode=_SKIP_RESPONSE_BODY,
                            metadata=usage_metadata(0), settle=self._settlement(forwarded, 0),
                            record=record)
        self._go("response_headers", Buffering(forwarded))
        return Continue(set_headers=cache)

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> Action:
        buffering = self.phase
        if not isinstance(buffering, Buffering):
            if isinstance(buffering, Done):
                return PASS  # a body Envoy sends after all (Done stays Done: no check needed)
            raise refuse(buffering, "response_body")
        buffer = buffering.buffer
        if not buffer.too_large:
            if len(buffer.data) + len(chunk) > MAX_RESPONSE_BYTES:
                buffer.too_large = True
                buffer.data = bytearray()
            else:
                buffer.data += chunk
        merging = buffering.forwarded.outcome == "partial"
        if not end_of_stream:
            return _HOLD if merging else PASS
        self._go("response_body", DONE)
        return self._finish(buffering.forwarded, buffer, merging)

    def _finish(self, forwarded: Forwarded, buffer: ResponseBuffer, merging: bool) -> Action:
        """At the end of vLLM's answer: the merged body, the vectors to store, tokens to charge."""
        request, outcome, reserved = forwarded.parsed, forwarded.outcome, forwarded.reserved
        try:
            if buffer.too_large:
                raise MergeError(f"the upstream answer is larger than {MAX_RESPONSE_BYTES} bytes")
            doc = parse_response(bytes(buffer.data))
            fresh = upstream_vectors(doc, forwarded.sent) if forwarded.sent else {}
            merged = None
            if merging and forwarded.resolution is not None:
                merged = merged_body(doc, forwarded.resolution, fresh)
        except MergeError as exc:
            log.warning("embeddings_unreadable_answer", request_id=self.ctx.request_id,
                        cache=outcome, error=str(exc))
            if merging:
                # The client has the 200 headers and nothing else; a wrong or partial list of
                # vectors is worse than a broken stream (Envoy resets it on this late reply).
                return Reply(502, error_body("The model backend's answer could not be merged "
                                             "with cached embeddings.", "server_error",
                                             "upstream_unavailable"),
                             details="embedding_cache_merge_failed",
                             record=self._record(request, outcome, 502, charged=None,
                                                 prompt_tokens=reserved))
            return Continue(metadata=usage_metadata(reserved),
                            settle=self._settlement(forwarded, reserved),
                            record=self._record(request, outcome, 200, charged=reserved,
                                                prompt_tokens=reserved))
        used = usage_tokens(doc)
        tokens = reserved if used is None else used
        store = None
        if forwarded.policy is not None and fresh:
            store = CacheWrite(entries_to_store(fresh), forwarded.policy.ttl_s)
        return Continue(body=merged, store=store, metadata=usage_metadata(tokens),
                        settle=self._settlement(forwarded, tokens),
                        record=self._record(request, outcome, 200, charged=tokens,
                                            prompt_tokens=tokens))

    def _settlement(self, forwarded: Forwarded, used: int) -> Settlement | None:
        """What extproc may settle itself, batched (the service decides, :mod:`extproc.settlements`);
        None when the route has no token limit."""
        return settlement_for(self.ctx.snapshot.config, forwarded.route, forwarded.lease, used)

    def on_close(self) -> RequestRecord | None:
        """A request sent upstream whose answer never ended (client gone, upstream reset):
        its record says aborted; nothing is settled."""
        phase = self.phase
        self._go("close", DONE)
        if isinstance(phase, Looking):
            return self._record(phase.parsed, None, 0, charged=None, prompt_tokens=0,
                                aborted=True)
        if isinstance(phase, Admitting):
            return self._record(phase.parsed, "hit", 0, charged=None, prompt_tokens=0,
                                aborted=True)
        if isinstance(phase, Forwarded):
            return self._record(phase.parsed, phase.outcome, 0, charged=None,
                                prompt_tokens=phase.reserved, aborted=True)
        if isinstance(phase, Buffering):
            forwarded = phase.forwarded
            return self._record(forwarded.parsed, forwarded.outcome, 200, charged=None,
                                prompt_tokens=forwarded.reserved, aborted=True)
        return None

    def _record(self, request: Parsed, outcome: CacheResult | None, status: int,
                charged: int | None, prompt_tokens: int, aborted: bool = False) -> RequestRecord:
        """This request's record: built once, as every caller leaves a phase for :class:`Done`."""
        ctx, decision = self.ctx, request.decision
        return RequestRecord(
            request_id=ctx.request_id, model=request.model.name, cluster=decision.cluster,
            variant=decision.variant, tenant=ctx.identity.tenant, status=status,
            streamed=False, errored=status >= 500, duration_s=ctx.clock() - ctx.started,
            ttft_s=None, tpot_s=None, prompt_tokens=prompt_tokens,
            completion_tokens=0, charged_tokens=charged, aborted=aborted, cache=outcome)


def _upstream_doc(request: Parsed) -> dict[str, Any]:
    doc = dict(request.body.doc)
    doc["model"] = request.decision.upstream_model
    return doc
