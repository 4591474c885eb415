"""What every processor shares: the :class:`Processor` interface (the four ext_proc phases for
one API kind), a pass-through base, and the routing steps a routed API kind takes (model lookup,
pool/canary/priority decision, the ``x-llm-*`` headers).

A processor sees plain values (headers as a mapping, body bytes) and returns actions; the stream
state in :mod:`extproc.stream` calls it, and :mod:`extproc.adapters.ext_proc_pb` builds the protobuf.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from extproc.actions import PASS, Action, Continue, Headers, ModeOverride, Reply, Step
from extproc.context import RequestContext
from extproc.decide import Decision, Demand, decide, parse_context_hint
from extproc.errors import (
    bad_request,
    model_not_found,
    unsupported_content_encoding,
    unsupported_media_type,
)
from extproc.records import RequestRecord
from routing.compiled import ModelRoute
from sidecar_runtime.wire.names import (
    CLUSTER_HEADER,
    CONTEXT_LENGTH_HEADER,
    KEY_ID_HEADER,
    MODEL_HEADER,
    PRIORITY_HEADER,
    TENANT_HEADER,
    VARIANT_HEADER,
)


class Processor(Protocol):
    """The four ext_proc request/response phases for one API kind."""

    def on_request_headers(self, end_of_stream: bool) -> Action: ...
    def on_request_body(self, body: bytes) -> Step: ...
    def on_response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action: ...
    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> Action: ...
    def on_close(self) -> RequestRecord | None: ...


class BaseProcessor:
    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx

    def on_request_headers(self, end_of_stream: bool) -> Action:
        return PASS

    def on_request_body(self, body: bytes) -> Step:
        return PASS

    def on_response_headers(self, headers: dict[str, str], end_of_stream: bool) -> Action:
        return PASS

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> Action:
        return PASS

    def on_close(self) -> RequestRecord | None:
        """The ext_proc stream ended (normally or not): the record of a request left
        unfinished (the stream returns it from its ``close``)."""
        return None


def route_headers(ctx: RequestContext, model: ModelRoute, decision: Decision) -> Headers:
    """The ``x-llm-*`` headers Envoy routes and rate-limits on (docs: Headers)."""
    return (
        (CLUSTER_HEADER, decision.cluster),
        (MODEL_HEADER, model.name),
        (TENANT_HEADER, ctx.identity.tenant),
        (KEY_ID_HEADER, ctx.identity.key_id),
        (CONTEXT_LENGTH_HEADER, str(decision.context_length)),
        (PRIORITY_HEADER, decision.priority),
        (VARIANT_HEADER, decision.variant),
    )


def decide_for(ctx: RequestContext, model: ModelRoute, prompt_tokens: int,
               output_tokens: int | None) -> Decision:
    """:func:`decide_demand_for` one prompt and one sequence (``output_tokens`` None: the
    model's default)."""
    return decide_demand_for(ctx, model, Demand((prompt_tokens,), output_tokens))


def decide_demand_for(ctx: RequestContext, model: ModelRoute, demand: Demand) -> Decision:
    """Pool, canary variant and priority of a request to ``model``: the canary in force when
    the request started (``ctx.canaries``), sticky on the canary's key (else the API key), and the client's
    ``X-Context-Length`` hint."""
    hint = parse_context_hint(ctx.headers.get("x-context-length"))
    canary = ctx.canaries.canary_for(model)
    routed = model if canary is model.canary else replace(model, canary=canary)
    return decide(routed, demand, hint,
                  ctx.sticky_value(canary.sticky if canary else "api_key"),
                  ctx.snapshot.high_below, ctx.snapshot.low_from)


def resolve_model(ctx: RequestContext, name: str, want: str) -> ModelRoute:
    model = ctx.snapshot.models.get(name)
    if model is None:
        raise model_not_found(name)
    if model.kind != want:
        what = "an embedding model" if model.kind == "embedding" else "a chat/completions model"
        raise bad_request(f"The model `{name}` is {what}; it cannot serve this endpoint.",
                          param="model", code="model_not_supported")
    return model


ENVOYS_OWN_ANSWER = Continue(mode=ModeOverride(response_headers=True, response_body="none"))


def envoys_own_answer() -> Continue:
    """Response headers before the request body was answered: Envoy replied itself (a body
    above its buffer limit gets its 413 while extproc may already have asked for response
    headers). The request reached no pool and reserved nothing: the answer passes as it is,
    unread and unrecorded, and no body message is asked for."""
    return ENVOYS_OWN_ANSWER


def body_required() -> Reply:
    err = bad_request("This endpoint needs a JSON request body.", code="invalid_json")
    return Reply(err.status, err.body())


def body_refused(ctx: RequestContext, end_of_stream: bool) -> Reply | None:
    """The answer to a request whose body cannot be read, at its headers: none; raises the 415
    of one compressed (neither extproc nor vLLM decompresses a request body; it would be read
    as bad JSON), and of one that is not ``application/json``: vLLM refuses any other media
    type, a missing one too (``validate_json_request``), so such a request would only reach a
    pod, and spend its rate limits, to be refused there."""
    if end_of_stream:
        return body_required()
    encoding = ctx.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise unsupported_content_encoding(encoding)
    media_type = ctx.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise unsupported_media_type()
    return None
