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

Every embeddings response that reaches vLLM is read to charge its ``usage`` tokens (CONTRACT §7);
the request-body answer that sends it upstream carries its reservation (the counted tokens of
the inputs that go upstream) as dynamic metadata. Every request that got past the body step is
recorded once (:class:`extproc.telemetry.events.RequestRecord`), as aborted when its stream ends first.
"""

from __future__ import annotations

from typing import Any, Literal

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
    Step,
    Verdict,
)
from extproc.admission import admission_metadata, usage_metadata
from extproc.bodies import EmbeddingsBody, parse_embeddings
from extproc.cache.keys import KeyPlan, namespace_for, plan_keys, request_salt
from extproc.cache.merge import (
    MergeError,
    Resolution,
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
from extproc.decide import Decision
from extproc.errors import error_body
from extproc.hit_limits import answer, hit_check
from extproc.processors.base import (
    BaseProcessor,
    body_required,
    decide_for,
    resolve_model,
    route_headers,
)
from extproc.telemetry.events import RequestRecord
from extproc.tokens import counter_for
from routing.compiled import CachePolicy, ModelRoute
from sidecar_runtime.logs import get_logger

log = get_logger("extproc.processors.embeddings")

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest vLLM answer held to merge or store (the gRPC message limit of extproc, too)."""

CACHE_HEADER = "x-llm-cache"
CacheResult = Literal["hit", "partial", "miss", "bypass"]
_STREAM_RESPONSE = ModeOverride(response_headers=True, response_body="streamed")
_SKIP_RESPONSE_BODY = ModeOverride(response_headers=False, response_body="none")
_HOLD = Continue(body=b"")
"""A chunk of a response that will be replaced: nothing of it reaches the client yet."""


class EmbeddingsProcessor(BaseProcessor):
    """``/v1/embeddings``, with the embedding cache for models that have ``cache:``."""

    def __init__(self, ctx: RequestContext) -> None:
        super().__init__(ctx)
        self.parsed: EmbeddingsBody | None = None
        self.model: ModelRoute | None = None
        self.decision: Decision | None = None
        self.counts: tuple[int, ...] = ()
        """The counted tokens of each input, in input order."""
        self.reserved = 0
        """The counted tokens of the inputs sent upstream: the request's reservation, and what
        is charged when vLLM's answer carries no usage."""
        self.plan: KeyPlan | None = None
        self.policy: CachePolicy | None = None
        self.outcome: CacheResult | None = None
        """None for a model without a cache."""
        self.resolution: Resolution | None = None
        self.sent: tuple[str, ...] = ()
        """The key of each input in the order it went upstream (vLLM's ``index`` points here)."""
        self.reading = False
        self.body = bytearray()
        self.too_large = False
        self.status = 0
        self.recorded = False

    def on_request_headers(self, end_of_stream: bool) -> Action:
        if end_of_stream:
            return body_required()
        # Whether the model is cached is only known from the body, and Envoy honours a mode
        # override only on a headers answer: ask for the response now, skip its body later.
        return Continue(mode=_STREAM_RESPONSE)

    def on_request_body(self, body: bytes) -> Step:
        parsed = parse_embeddings(body)
        model = resolve_model(self.ctx, parsed.model, "embedding")
        counter = counter_for(model.tokenizer)
        counts = [counter.count(item) if isinstance(item, str) else len(item)
                  for item in parsed.inputs]
        decision = decide_for(self.ctx, model, max(counts), 0)
        self.parsed, self.model, self.decision = parsed, model, decision
        self.counts = tuple(counts)
        policy = model.cache
        if policy is None:
            return self._forward(None)
        namespace = namespace_for(policy, decision.variant, decision.upstream_model,
                                  self.ctx.identity.tenant)
        salt = request_salt(parsed.dimensions, parsed.encoding_format, parsed.doc)
        self.plan = plan_keys(namespace, salt, parsed.inputs)
        self.policy = policy
        return Lookup(self.plan.distinct, self.on_lookup)

    def on_lookup(self, found: Found) -> Step:
        """The next step of the request body, once the cache has answered the lookup."""
        assert self.plan is not None and self.decision is not None
        if found is None:
            self.outcome = "bypass"
            return self._forward(None)
        resolution = resolve(self.plan, found)
        self.outcome, self.resolution = resolution.outcome, resolution
        if resolution.outcome == "hit":
            assert self.model is not None
            check = hit_check(self.ctx.snapshot, route_headers(self.ctx, self.model, self.decision),
                              self.on_admitted)
            return self.on_admitted(Verdict("ok")) if check is None else check
        if resolution.outcome == "miss":
            self.sent = self.plan.keys
            return self._forward(None)
        self.sent = resolution.missing
        return self._forward(missing_body(self._upstream_doc(), resolution))

    def _hit(self) -> Reply:
        """The answer of a request whose every input was cached."""
        assert self.resolution is not None and self.decision is not None
        request_id = self.ctx.request_id or "local"
        return Reply(200, hit_body(self.resolution, self.decision.upstream_model,
                                   f"embd-cache-{request_id}"),
                     headers=(("content-type", "application/json"), (CACHE_HEADER, "hit")))

    def on_admitted(self, verdict: Verdict) -> Reply:
        """A hit's answer once the rate limiter has judged it: as Envoy's filter would have."""
        reply = answer(verdict, self._hit(),
                       self.ctx.snapshot.config.services.ratelimit_failure_mode_deny)
        self.status = reply.status
        self._record(charged=0)
        return reply

    def _upstream_doc(self) -> dict[str, Any]:
        assert self.parsed is not None and self.decision is not None
        doc = dict(self.parsed.doc)
        doc["model"] = self.decision.upstream_model
        return doc

    def _forward(self, body: bytes | None) -> Action:
        """Route the request upstream, its body replaced by ``body`` (else by a canary rename)."""
        assert self.parsed is not None and self.model is not None and self.decision is not None
        decision = self.decision
        if body is None and decision.upstream_model != self.parsed.model:
            body = orjson.dumps(self._upstream_doc())
        headers: Headers = route_headers(self.ctx, self.model, decision)
        if body is not None:
            headers += (("content-length", str(len(body))),)
        self.ctx.telemetry.routed(self.model.name, decision.cluster, decision.variant)
        if self.outcome == "partial":
            assert self.plan is not None and self.resolution is not None
            per_key = dict(zip(self.plan.keys, self.counts, strict=True))
            self.reserved = sum(per_key[key] for key in self.resolution.missing)
        else:
            self.reserved = sum(self.counts)
        # The answer is read (usage, vectors, merge): ask for it uncompressed.
        return Continue(set_headers=headers, remove_headers=("accept-encoding",), body=body,
                        clear_route_cache=True,
                        metadata=admission_metadata(self.reserved))

    def on_response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action:
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        cache: Headers = ((CACHE_HEADER, self.outcome),) if self.outcome is not None else ()
        if status != "200" or end_of_stream or self.decision is None:
            # An error (or nothing) from upstream is passed on as it is: nothing to store,
            # nothing to merge, and no tokens computed to charge.
            self._record(charged=0)
            return Continue(set_headers=cache, mode=_SKIP_RESPONSE_BODY)
        self.reading = True
        return Continue(set_headers=cache)

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> Action:
        if not self.reading:
            return PASS
        if not self.too_large:
            if len(self.body) + len(chunk) > MAX_RESPONSE_BYTES:
                self.too_large = True
                self.body = bytearray()
            else:
                self.body += chunk
        merging = self.outcome == "partial"
        if not end_of_stream:
            return _HOLD if merging else PASS
        self.reading = False
        return self._finish(merging)

    def _finish(self, merging: bool) -> Action:
        """At the end of vLLM's answer: the merged body, the vectors to store, tokens to charge."""
        try:
            if self.too_large:
                raise MergeError(f"the upstream answer is larger than {MAX_RESPONSE_BYTES} bytes")
            doc = parse_response(bytes(self.body))
            fresh = upstream_vectors(doc, self.sent) if self.sent else {}
            merged = None
            if merging:
                assert self.resolution is not None
                merged = merged_body(doc, self.resolution, fresh)
        except MergeError as exc:
            log.warning("embeddings_unreadable_answer", request_id=self.ctx.request_id,
                        cache=self.outcome, error=str(exc))
            if merging:
                # The client has the 200 headers and nothing else; a wrong or partial list of
                # vectors is worse than a broken stream (Envoy resets it on this late reply).
                self.status = 502
                self._record(charged=None)
                return Reply(502, error_body("The model backend's answer could not be merged "
                                             "with cached embeddings.", "server_error",
                                             "upstream_unavailable"),
                             details="embedding_cache_merge_failed")
            self._record(charged=self.reserved)
            return Continue(metadata=usage_metadata(self.reserved))
        used = usage_tokens(doc)
        tokens = self.reserved if used is None else used
        store = None
        if self.policy is not None and fresh:
            store = CacheWrite(entries_to_store(fresh), self.policy.ttl_s)
        self._record(charged=tokens, prompt_tokens=tokens)
        return Continue(body=merged, store=store, metadata=usage_metadata(tokens))

    def on_close(self) -> None:
        """A request sent upstream whose answer never ended (client gone, upstream reset):
        recorded as aborted; nothing is settled."""
        self._record(charged=None, aborted=True)

    def _record(self, charged: int | None, aborted: bool = False,
                prompt_tokens: int | None = None) -> None:
        """Report this request once, however it ended."""
        ctx, decision, model = self.ctx, self.decision, self.model
        if self.recorded or decision is None or model is None:
            return
        self.recorded = True
        if prompt_tokens is None:
            prompt_tokens = 0 if self.outcome == "hit" else self.reserved
        ctx.telemetry.request_done(RequestRecord(
            request_id=ctx.request_id, model=model.name, cluster=decision.cluster,
            variant=decision.variant, tenant=ctx.identity.tenant, status=self.status,
            streamed=False, errored=self.status >= 500, duration_s=ctx.clock() - ctx.started,
            ttft_s=None, tpot_s=None, prompt_tokens=prompt_tokens,
            completion_tokens=0, charged_tokens=charged, aborted=aborted, cache=self.outcome))
