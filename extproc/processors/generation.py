"""The chat/completions processor: routes the request, and reads the response when extproc must
(sampled, canary, or usage Envoy cannot read) for its timings and the tokens to settle."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import orjson

from extproc.actions import (
    PASS,
    Action,
    Continue,
    Hold,
    ModeOverride,
    Settlement,
    ShadowJob,
    Step,
    Waited,
    evolve,
)
from extproc.admission import admission_metadata, new_lease, usage_metadata
from extproc.bodies import Api, GenerationBody, parse_generation
from extproc.cache_salt import FIELD as CACHE_SALT
from extproc.cache_salt import upstream_salt
from extproc.canary.text import AnswerText
from extproc.context import RequestContext
from extproc.decide import Decision, Demand, output_per_sequence
from extproc.errors import flow_refused, server_overloaded
from extproc.output_budget import upstream_max_tokens
from extproc.picker.pick import Priority
from extproc.picker.scoring import Work
from extproc.processors.base import (
    BaseProcessor,
    body_refused,
    decide_demand_for,
    envoys_own_answer,
    resolve_model,
    route_headers,
)
from extproc.processors.phases import (
    AWAITING_BODY,
    DONE,
    GENERATION,
    AwaitingBody,
    Done,
    Event,
    GenerationPhase,
    Reading,
    Routed,
    advance,
    refuse,
)
from extproc.records import RequestRecord, RouteChosen
from extproc.sampling import sampled, stable_share, usage_plan
from extproc.settlements import settlement_for
from extproc.tokens import count_prompt, counter_for
from extproc.usage import Usage, UsageMeter, UsageStripper, settled_tokens, tokens_to_charge
from routing.compiled import ModelRoute
from routing.picker_schema import FlowControlSpec
from sidecar_runtime.wire.names import (
    ENVOY_USAGE_HEADER,
    QUEUED_HEADER,
    RATELIMIT_BACKEND_HEADER,
    STRIP_USAGE_METADATA_KEY,
)

UPSTREAM_ANSWERED = "x-envoy-upstream-service-time"
"""Envoy's router adds it to a response an upstream sent, never to a local reply."""

_NO_RESPONSE_BODY = ModeOverride(response_headers=True, response_body="none")
_READ_RESPONSE = Continue(mode=ModeOverride(response_headers=True, response_body="streamed"))
"""The answer to every request's headers (values are frozen: one serves every request)."""


SHADOW_ID = "shadow\0"
"""Salts the request id for the shadow draw, so it is independent of the telemetry sample."""


def first_prompt(parsed: GenerationBody) -> bytes:
    """The first prompt's text in order: what a pool's prefix cache, and so its picker, keys on
    (not the JSON body, whose leading fields differ between identical prompts)."""
    return "\x1e".join(parsed.prompts[0].texts).encode() if parsed.prompts else b""


def shadow_body(doc: dict[str, Any], canary_model: str) -> bytes:
    """The request as stable's pool got it (``doc``), for ``canary_model``: streamed with usage
    (the pair's TTFT, time per output token and completion tokens come from it)."""
    shadow = dict(doc)
    shadow["model"] = canary_model
    shadow["stream"] = True
    shadow["stream_options"] = {"include_usage": True}
    return orjson.dumps(shadow)


class GenerationProcessor(BaseProcessor):
    """``/v1/chat/completions`` and ``/v1/completions``.

    extproc reads a response (streamed through it, never held back) when it is sampled, on the
    canary, or when Envoy cannot read its usage (:mod:`extproc.sampling`): then the tokens it
    used go to the rate limiter as dynamic metadata at its end. Every other response (a stream)
    is read by Envoy alone: extproc sees its headers (status, for the request count and the
    settlement of an error) and asks for no body.
    """

    def __init__(self, ctx: RequestContext, api: Api) -> None:
        super().__init__(ctx)
        self.api = api
        self.phase: GenerationPhase = AWAITING_BODY
        self._prompt = b""
        """The first prompt's text, kept for a shadow (what the canary pool's picker keys on)."""
        self.picked: tuple[str, str] | None = None
        """The pool and pod the endpoint picker sent this request to (told at the stream's
        end, whatever the phase: the pod has one request less open from this replica)."""
        self._fills = False
        """The pick put this request into its pod's last free slot (flow control)."""
        self._read = False
        """Its response is read (to its end, unless the client goes first)."""

    def on_request_headers(self, end_of_stream: bool) -> Action:
        refused = body_refused(self.ctx, end_of_stream)
        if refused is not None:
            return refused
        return _READ_RESPONSE

    def on_response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action:
        routed = self.phase
        action = self._response_headers(headers, end_of_stream)
        if isinstance(routed, Routed) and routed.queued_s is not None \
                and isinstance(action, Continue):
            waited = (QUEUED_HEADER, str(round(routed.queued_s * 1000)))
            return evolve(action, set_headers=(*action.set_headers, waited))
        return action

    def _response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action:
        routed = self.phase
        if not isinstance(routed, Routed):
            if isinstance(routed, AwaitingBody):
                self.phase = advance(GENERATION, routed, "response_headers", DONE)
                return envoys_own_answer()
            raise refuse(routed, "response_headers")
        status = headers.get(":status", "0")
        streamed = headers.get("content-type", "").startswith("text/event-stream")
        reading = Reading(routed, int(status) if status.isdigit() else 0, streamed,
                          # The rate limiter's own replies (429, or 503 when its store is
                          # down) mark themselves.
                          "x-envoy-ratelimited" in headers or RATELIMIT_BACKEND_HEADER in headers,
                          UsageMeter(streamed),
                          stripper=UsageStripper() if streamed and routed.strip_usage else None,
                          answer=AnswerText(streamed) if routed.shadow is not None else None)
        if self.picked is not None and self.ctx.picker is not None \
                and UPSTREAM_ANSWERED in headers:
            # The pod's own answer: a run of 5xx ejects it. Envoy's local replies (the rate
            # limiter's 429 and its 503 when its service fails, a circuit breaker's 503, a
            # timeout's 504) carry no upstream service time and say nothing of the pod.
            self.ctx.picker.answered(*self.picked, reading.status)
        if not routed.reads_body:
            return self._headers_only(reading)
        if end_of_stream:
            return self._finish(reading, routed, "response_headers")
        self.phase = advance(GENERATION, routed, "response_headers", reading)
        return PASS

    def _headers_only(self, reading: Reading) -> Action:
        """A response extproc does not read: recorded now, without timings or token counts
        (``sampled`` false); no body is asked for. An error status settles 0 here: an error
        body carries no usage chunk for Envoy to read."""
        self.phase = advance(GENERATION, reading.routed, "response_headers", DONE)
        charged = 0 if reading.status >= 400 else None
        record = self._report(reading, Usage(None, None, None, 0), charged, sampled=False)
        if charged is None:
            return Continue(mode=_NO_RESPONSE_BODY, record=record)
        return Continue(mode=_NO_RESPONSE_BODY, metadata=usage_metadata(0),
                        settle=self._settlement(reading.routed, 0), record=record)

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> Action:
        reading = self.phase
        if not isinstance(reading, Reading):
            if isinstance(reading, Done):
                return PASS  # chunks after the end pass (Done stays Done: no check needed)
            if not isinstance(reading, Routed):
                raise refuse(reading, "response_body")
            # No response headers seen: read as a non-streamed answer of unknown status.
            reading = self.phase = advance(GENERATION, reading, "response_body",
                                           Reading(reading, 0, False, False, UsageMeter(False)))
        if reading.meter.feed(chunk):
            now = self.ctx.clock()
            times = reading.times
            if times.first is None:
                times.first = now
            times.last = now
        if reading.answer is not None:
            reading.answer.feed(chunk)
        sent = reading.stripper.feed(chunk) if reading.stripper is not None else None
        # Finish on ``[DONE]``, not only at end of stream: a client that hangs up right after
        # it (the openai SDK does) resets the stream before its end reaches extproc, and the
        # request would then go unrecorded and its tokens uncharged.
        if end_of_stream or reading.meter.done:
            finished = self._finish(reading, reading, "response_body")
            return finished if sent is None else replace(finished, body=sent)
        return PASS if sent is None else Continue(body=sent)

    def _finish(self, reading: Reading, phase: Routed | Reading, event: Event) -> Action:
        """At end of stream: the tokens the response used, for the rate limiter to settle the
        reservation with; none when they are not known (the reservation then stands).

        Runs once per request (the phase is then :class:`Done`; later chunks pass through).
        """
        self.phase = advance(GENERATION, phase, event, DONE)
        self._pod_done()
        decision = reading.routed.decision
        usage = reading.meter.finish()
        used = settled_tokens(usage, reading.status)
        record = self._report(reading, usage, used if used is not None else tokens_to_charge(
            usage, decision.prompt_tokens, decision.output_tokens))
        shadow = self._shadow(reading, record)
        if used is None:
            return Continue(record=record, shadow=shadow)
        settle = None if reading.routed.envoy_reads_usage and reading.streamed \
            else self._settlement(reading.routed, used)
        return Continue(metadata=usage_metadata(used), settle=settle, record=record,
                        shadow=shadow)

    def _shadow(self, reading: Reading, record: RequestRecord) -> ShadowJob | None:
        """The replay on the canary of a complete, good stable answer chosen for one."""
        body, answer = reading.routed.shadow, reading.answer
        if body is None or answer is None or reading.status != 200 or record.errored:
            return None
        answer.finish()
        canary = self.ctx.canaries.canary_for(self.ctx.snapshot.models[reading.routed.model])
        if answer.broken or not answer.text or canary is None:
            return None  # the canary may have been stopped meanwhile
        pool = self.ctx.snapshot.config.clusters[record.cluster]
        return ShadowJob(record.model, canary, self.ctx.path, body, self._prompt,
                         answer.text, record.ttft_s, record.tpot_s,
                         pool.cost_of(record.completion_tokens))

    def _settlement(self, routed: Routed, used: int) -> Settlement | None:
        """What extproc may settle itself (the service decides: see :mod:`extproc.settlements`);
        the answer's ``llm_done`` stays for Envoy otherwise."""
        return settlement_for(self.ctx.snapshot.config, routed.route, routed.lease, used)

    def on_close(self) -> RequestRecord | None:
        """A request routed upstream whose response never ended: the client hung up or the
        upstream reset (Envoy then resets the ext_proc stream). Its record says aborted,
        with the completion tokens streamed so far; nothing is settled.

        Every stream of a picked request ends here, so this is where the picker hears the pod
        has one request less open from this replica. For a response extproc does not read,
        that is at its headers: the open count then covers requests the pod has not started
        answering, and the scraped queue covers the rest."""
        self._pod_done()
        phase = self.phase
        self.phase = advance(GENERATION, phase, "close", DONE)
        if isinstance(phase, Routed):
            phase = Reading(phase, 0, False, False, UsageMeter(streaming=False))
        if isinstance(phase, Reading):
            return self._report(phase, phase.meter.finish(), None, aborted=True)
        return None

    def _pod_done(self) -> None:
        """Tell the picker the pod has one request less open from this replica (once); whether
        its response was read, so this is its end on the pod, or not."""
        if self.picked is not None and self.ctx.picker is not None:
            self.ctx.picker.done(*self.picked, unread=not self._read)
            self.picked = None

    def _report(self, reading: Reading, usage: Usage, charged: int | None,
                aborted: bool = False, sampled: bool = True) -> RequestRecord:
        ctx, decision = self.ctx, reading.routed.decision
        now = ctx.clock()
        first, last = reading.times.first, reading.times.last
        sent = reading.routed.sent_at
        ttft = first - (sent if sent is not None else ctx.started) \
            if reading.streamed and first is not None else None
        tpot = None
        # Per sequence: n choices (and a completions batch's prompts) decode side by side, and
        # a chunk may carry several tokens (vLLM's --stream-interval): the usage says how many.
        generated = usage.completion_tokens if usage.completion_tokens is not None \
            else usage.streamed_tokens
        per_sequence = generated / decision.sequences
        if ttft is not None and first is not None and last is not None and per_sequence > 1:
            tpot = (last - first) / (per_sequence - 1)
        record = RequestRecord(
            request_id=ctx.request_id,
            model=reading.routed.model,
            cluster=decision.cluster,
            variant=decision.variant,
            tenant=ctx.identity.tenant,
            status=reading.status,
            streamed=reading.streamed,
            errored=usage.errored or reading.status >= 500,
            duration_s=now - ctx.started,
            ttft_s=ttft,
            tpot_s=tpot,
            prompt_tokens=usage.prompt_tokens if usage.prompt_tokens is not None
            else decision.prompt_tokens,
            completion_tokens=usage.completion_tokens if usage.completion_tokens is not None
            else usage.streamed_tokens,
            charged_tokens=charged,
            aborted=aborted,
            limited=reading.limited,
            sampled=sampled,
            by_floor=reading.routed.by_floor,
            queued_s=reading.routed.queued_s,
        )
        return record

    def on_request_body(self, body: bytes) -> Step:
        if not isinstance(self.phase, AwaitingBody):
            raise refuse(self.phase, "request_body")
        parsed = parse_generation(self.api, body)
        model = resolve_model(self.ctx, parsed.model, "chat")
        salt = upstream_salt(model.salts_by_tenant, self.ctx.identity.tenant, parsed.doc)
        counter = counter_for(model.tokenizer)
        counts = tuple(count_prompt(counter, prompt, model.media_tokens)
                       for prompt in parsed.prompts)
        demand = Demand(counts, parsed.max_output_tokens, parsed.choices, parsed.min_output_tokens)
        decision = decide_demand_for(self.ctx, model, demand)
        flow = self._flow_control(decision.cluster)
        picker = self.ctx.picker
        if flow is not None and picker is not None and picker.must_wait(decision.cluster):
            # Every pod is busy (or others wait already): the request waits here, and is
            # picked for when a pod has room (docs: Flow control).
            return Hold(decision.cluster, decision.priority, self.ctx.identity.tenant,
                        len(body), flow.max_wait_s, flow.max_queue, flow.max_queue_bytes,
                        flow.fairness,
                        pick=lambda: self._pick(decision, parsed, salt, room_only=True),
                        resume=lambda waited: self._after_wait(waited, flow.retry_after_s,
                                                               model, parsed, demand, decision,
                                                               salt))
        pods = self._pick(decision, parsed, salt, room_only=flow is not None)
        # Into the pod's last free slot: its end is the next request's room, so it is read to
        # its end; a request sent into room to spare is not (docs: Flow control).
        return self._route(model, parsed, demand, decision, salt, pods, None, self._fills)

    def _flow_control(self, cluster: str) -> FlowControlSpec | None:
        picker_spec = self.ctx.snapshot.config.clusters[cluster].endpoint_picker
        return picker_spec.flow_control if picker_spec is not None else None

    def _after_wait(self, waited: Waited, retry_after_s: int, model: ModelRoute,
                    parsed: GenerationBody, demand: Demand, decision: Decision,
                    salt: str | None) -> Continue:
        """The request-body answer of a request that waited: a 503 when it was refused (it
        reached no pod, reserved nothing), else routed to the pods picked at its release."""
        if waited.pods is None:
            raise flow_refused(decision.cluster, waited.reason, retry_after_s, waited.waited_s)
        return self._route(model, parsed, demand, decision, salt, waited.pods, waited.waited_s,
                           True)

    def _route(self, model: ModelRoute, parsed: GenerationBody, demand: Demand,
               decision: Decision, salt: str | None, pods: tuple[str, ...],
               queued_s: float | None, read_to_end: bool) -> Continue:
        """The request-body answer that sends the request to its pool (``pods`` first, when
        picked), with its reservation; ``queued_s``: how long it waited for them;
        ``read_to_end``: flow control needs the moment it ends (it waited, or took a pod's last
        free slot), so its response is read to the end."""
        snapshot = self.ctx.snapshot
        canary = self.ctx.canaries.canary_for(model)
        plan = usage_plan(parsed)
        limited = snapshot.config.rate_limits is not None
        # A stream a limit settles always carries vLLM's usage chunk: when its client did not
        # ask for one, extproc asks, and the chunk is taken out of what the client receives
        # (by Envoy's Lua filter, else by extproc). Counting content chunks instead would
        # miss reasoning and tool-call deltas and every chunk of several tokens.
        inject = limited and plan == "envoy_injected"
        envoy_reads = snapshot.config.telemetry.envoy_usage \
            and self.ctx.headers.get(ENVOY_USAGE_HEADER) == "1"
        if not envoy_reads:
            plan = "extproc"  # this Envoy cannot read the usage (an Istio EnvoyFilter)
        telemetry = snapshot.config.telemetry
        compare = canary.compare if canary is not None and decision.variant == "stable" else None
        # A share of stable answers is replayed on the canary and compared: those are read,
        # for their text (docs: Canary verdict).
        shadowed = compare is not None \
            and self.ctx.identity.tenant not in compare.exclude_tenants \
            and sampled(SHADOW_ID + self.ctx.request_id, compare.shadow_percent / 100)
        reads_body = (
            read_to_end
            or shadowed
            or decision.variant == "canary"
            or sampled(self.ctx.request_id, stable_share(
                telemetry.sample, canary.percent if canary else None))
            # Without rate limits no usage is settled: only sampling decides.
            or (limited and plan == "extproc"))
        headers = route_headers(self.ctx, model, decision)
        route = dict(headers)  # the level values Envoy's rate-limit descriptors read
        lease = new_lease()
        # The time read for TTFT serves the floor's second too (no second clock read per
        # request); the floor is asked only about responses nothing else reads.
        sent_at = self.ctx.clock()
        floor = self.ctx.read_floor
        by_floor = not reads_body and floor is not None \
            and floor.take(model.name, telemetry.sample_min_per_s, sent_at)
        new_body = None
        doc = parsed.doc
        # A client's own ``priority`` never reaches vLLM: with priority scheduling it would jump
        # the queue (lower is served first), so it is replaced by the tier, or dropped.
        client_priority = "priority" in parsed.doc
        # A request that sets no output budget gets the one its reservation assumed, when a
        # token bucket charges it: vLLM would otherwise give it the rest of the context window.
        budget = upstream_max_tokens(snapshot.config, self.api, parsed.doc,
                                     output_per_sequence(demand, model.default_max_tokens),
                                     route)
        if decision.upstream_model != parsed.model or snapshot.inject_priority or inject \
                or client_priority or budget is not None or salt is not None:
            doc = dict(parsed.doc)
            if salt is not None:  # never the client's own as sent
                doc[CACHE_SALT] = salt
            if budget is not None:
                doc["max_tokens"] = budget
            doc["model"] = decision.upstream_model
            if snapshot.inject_priority:
                doc["priority"] = ("high", "medium", "low").index(decision.priority)
            else:
                doc.pop("priority", None)
            if inject:
                # Only the usage flag: vLLM ignores continuous_usage_stats without it, so the
                # client gets no per-chunk usage it did not get before.
                doc["stream_options"] = {"include_usage": True}
            new_body = orjson.dumps(doc)
        shadow = None
        if shadowed and canary is not None:
            shadow = shadow_body(doc, canary.model)
            self._prompt = first_prompt(parsed)
        self._read = reads_body or by_floor
        self.phase = advance(GENERATION, self.phase, "request_body",
                             Routed(decision, model.name, reads_body or by_floor, lease,
                                    headers, envoy_reads and parsed.stream
                                    and (parsed.include_usage or inject),
                                    strip_usage=inject and not envoy_reads,
                                    sent_at=sent_at, by_floor=by_floor, queued_s=queued_s,
                                    shadow=shadow))
        if new_body is not None:
            headers += (("content-length", str(len(new_body))),)
        # The reservation and the lease ride on the request-body answer so the rate-limit
        # filter, which runs after ext_proc, can charge it at admission (docs: Rate limits).
        metadata = admission_metadata(snapshot.config, route, decision.reservation, lease)
        if inject and envoy_reads:  # Envoy's Lua filter takes the chunk out
            metadata = {**metadata, STRIP_USAGE_METADATA_KEY: "1"}
        return Continue(set_headers=headers, body=new_body, clear_route_cache=True,
                        metadata=metadata, lb_endpoints=pods,
                        route=RouteChosen(model.name, decision.cluster, decision.variant))

    def _pick(self, decision: Decision, parsed: GenerationBody,
              salt: str | None, room_only: bool = False) -> tuple[str, ...]:
        """The pods to try, best first, when the pool has an endpoint picker (else none: Envoy
        balances it); a 503 ``server_overloaded`` for a low-priority request to a saturated
        pool. The prefix the picker keys on is the first prompt's text in order, within the
        request's ``cache_salt`` as vLLM gets it (``salt``). ``room_only``: a flow-controlled
        pool's pick (:meth:`~extproc.picker.pick.EndpointPicker.pick`)."""
        picker = self.ctx.picker
        spec = self.ctx.snapshot.config.clusters[decision.cluster].endpoint_picker
        if picker is None or spec is None:
            return ()  # before joining the prompt: most pools have no picker
        prompt = first_prompt(parsed)
        work = Work(decision.prompt_tokens, decision.output_tokens)
        pick = picker.pick(decision.cluster, prompt, cast(Priority, decision.priority), salt, work,
                           room_only)
        if pick is None or pick.endpoint is None:
            if pick is not None and pick.shed and spec.saturation:
                raise server_overloaded(decision.cluster, spec.saturation.retry_after_s)
            return ()
        self.picked = (decision.cluster, pick.endpoint)
        self._fills = pick.fills
        return (pick.endpoint, *pick.fallbacks)
