"""HTTP handlers: decode, decide with the pure modules, pace with the engine, write the answer.

Every refusal is raised as ``SimError`` and turned into vLLM's error body by the app's middleware.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from simulator import embeddings, sse
from simulator.dcgm import simulated_reading
from simulator.errors import bad_request, engine_dead, metrics_failure, validation_error
from simulator.generation import SequencePlan, check_pooling_context, plan_output
from simulator.metrics import CONTENT_TYPE
from simulator.overrides import parse_overrides
from simulator.prefix import prompt_blocks
from simulator.protocol import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
)
from simulator.responses import (
    ResponseMeta,
    Usage,
    chat_completion,
    embedding_list,
    model_list,
    text_completion,
    usage_of,
)
from simulator.state import STATE, SimState
from simulator.tokens import count_prompt_tokens


@dataclass(frozen=True)
class ParsedBody:
    """A request body decoded once: its JSON value, or why it is not JSON."""

    value: object
    error: str | None


BODY = web.RequestKey("simulator_body", ParsedBody)


def parse_body(raw: bytes) -> ParsedBody:
    """Decode ``raw`` as JSON; an empty or invalid body keeps the reason for a later 400."""
    if not raw:
        return ParsedBody(None, "The request body is empty; expected a JSON object.")
    try:
        return ParsedBody(orjson.loads(raw), None)
    except orjson.JSONDecodeError as exc:
        return ParsedBody(None, f"JSON decode error: {exc}")


def json_response(body: Any, status: int = 200) -> web.Response:
    """``body`` as an ``application/json`` response."""
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


TOO_DEEP = "<nested deeper than the journal can write>"


def _written(entry: dict[str, Any]) -> str:
    """A journal entry as JSON text: vLLM (and the simulator) read bodies nested up to 1,024
    levels, orjson writes 255 and the standard library about 990, so a body deeper still is
    written as :data:`TOO_DEEP` (once such a request is recorded, the journal still answers)."""
    try:
        return json.dumps(entry)
    except RecursionError:
        return json.dumps({**entry, "body": TOO_DEEP})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, parse_chat_request(_body(request)), chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, parse_completion_request(_body(request)), chat=False)


async def embeddings_endpoint(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``."""
    state = request.app[STATE]
    config = state.config
    parsed = parse_embedding_request(_body(request))
    model = state.resolve_model(parsed.model)
    counts = [count_prompt_tokens(item, state.tokenizer) for item in parsed.inputs]
    for count in counts:
        check_pooling_context(count, config.max_model_len)
    if parsed.dimensions is not None and parsed.dimensions > config.embedding_dim:
        raise validation_error(
            f"dimensions={parsed.dimensions} is larger than the model's embedding size "
            f"{config.embedding_dim}.",
            "dimensions",
            parsed.dimensions,
        )
    plans = tuple(SequencePlan(count, (), "stop") for count in counts)
    async with aclosing(state.engine.run(plans, parsed.priority)) as events:
        async for _ in events:
            pass
    vectors = [embeddings.embed(item, config.embedding_dim) for item in parsed.inputs]
    if parsed.dimensions is not None:
        vectors = [embeddings.truncate(v, parsed.dimensions) for v in vectors]
    wire: list[list[float] | str] = (
        [embeddings.encode_base64(v) for v in vectors]
        if parsed.encoding_format == "base64"
        else list(vectors)
    )
    meta = ResponseMeta(_request_id(request, "embd"), int(time.time()), model)
    return json_response(embedding_list(meta, wire, sum(counts)))


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    state = request.app[STATE]
    return json_response(model_list(state.listed_models(), state.created, state.config.max_model_len))


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body, as vLLM answers while it serves."""
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text (a 500 while ``fail_metrics`` is overridden)."""
    state = request.app[STATE]
    if state.metrics.overrides.fail_metrics:
        raise metrics_failure()
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def dcgm_metrics(request: web.Request) -> web.Response:
    """``GET /dcgm/metrics``: dcgm-exporter-style GPU gauges (a 500 while ``fail_dcgm``)."""
    state = request.app[STATE]
    overrides = state.metrics.overrides
    if overrides.fail_dcgm:
        raise metrics_failure()
    real = simulated_reading(state.engine.kv_usage, state.engine.admission.running)
    body = state.dcgm.render(overrides.gpu(real))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def get_state(request: web.Request) -> web.Response:
    """``GET /sim/state`` (simulator only): the pod's settings, the overrides in force and the
    real values they hide."""
    return json_response(_state_view(request.app[STATE]))


async def set_state(request: web.Request) -> web.Response:
    """``POST /sim/state`` (simulator only): replace the overrides (see ``simulator.overrides``)."""
    state = request.app[STATE]
    parsed = parse_body(await request.read())
    if parsed.error is not None:
        raise bad_request(parsed.error)
    state.metrics.set_overrides(parse_overrides(parsed.value))
    return json_response(_state_view(state))


def _state_view(state: SimState) -> dict[str, Any]:
    running, waiting, kv_usage = state.metrics.real_load
    gpu = simulated_reading(kv_usage, running)
    config = state.config
    return {
        "settings": {
            "speed": config.speed,
            "kv_capacity_tokens": config.kv_capacity,
            "prefix_block_size": config.prefix_block_size,
            "max_num_seqs": config.max_num_seqs,
        },
        "overrides": state.metrics.overrides.as_json(),
        "real": {
            "running": running,
            "waiting": waiting,
            "peak_waiting": state.engine.admission.peak_waiting,
            "kv_usage": kv_usage,
            "kv_used_tokens": state.engine.admission.kv_used,
            "prefix_cached_blocks": len(state.engine.prefix_cache),
            "gpu_temp_c": gpu.temp_c,
            "fb_used_mib": gpu.fb_used_mib,
            "fb_free_mib": gpu.fb_free_mib,
            "throttle_reasons": gpu.throttle_reasons,
        },
    }


async def list_requests(request: web.Request) -> web.Response:
    """``GET /sim/requests`` (simulator only): the journal, oldest first."""
    entries = request.app[STATE].journal.entries()
    try:
        return json_response(entries)
    except orjson.JSONEncodeError:  # a body nested deeper than orjson writes
        text = "[" + ", ".join(_written(entry) for entry in entries) + "]"
        return web.Response(text=text, content_type="application/json")


async def clear_requests(request: web.Request) -> web.Response:
    """``DELETE /sim/requests`` (simulator only): empty the journal, and start the
    ``peak_waiting`` of ``/sim/state`` over from what waits now."""
    state = request.app[STATE]
    admission = state.engine.admission
    admission.peak_waiting = admission.waiting
    return json_response({"deleted": state.journal.clear()})


def _body(request: web.Request) -> object:
    # vLLM's ``validate_json_request`` runs before the body is read: any media type but
    # application/json (a missing one too) is its RequestValidationError, a 400.
    media_type = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise bad_request("1 validation error:\n  Unsupported Media Type: Only "
                          "'application/json' is allowed\n")
    parsed = request.get(BODY)
    if parsed is None:
        raise bad_request("The request body is empty; expected a JSON object.")
    if parsed.error is not None:
        raise bad_request(parsed.error)
    return parsed.value


def _request_id(request: web.Request, prefix: str) -> str:
    # vLLM takes the caller's X-Request-Id as the base of the response id when one is sent.
    base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return f"{prefix}-{base}"


async def _generate(request: web.Request, parsed: GenerationRequest, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if state.metrics.overrides.fail_requests:
        raise engine_dead()
    config = state.config
    model = state.resolve_model(parsed.model)
    plans = tuple(
        plan_output(
            prompt,
            count_prompt_tokens(prompt, state.tokenizer),
            parsed.max_tokens,
            config.default_output_tokens,
            config.max_model_len,
            prompt_blocks(prompt, state.tokenizer, config.prefix_block_size, salt=parsed.cache_salt),
            config.natural_stop,
            parsed.min_tokens,
            choice,
            config.drift,
        )
        for prompt in parsed.prompts
        for choice in range(parsed.n)
    )
    meta = ResponseMeta(_request_id(request, "chatcmpl" if chat else "cmpl"), int(time.time()), model)
    if parsed.stream:
        return await _stream(request, state, parsed, plans, meta, chat=chat)
    async with aclosing(state.engine.run(plans, parsed.priority)) as events:
        async for _ in events:
            pass
    body = chat_completion(meta, plans) if chat else text_completion(meta, plans, parsed.n)
    return json_response(body)


async def _stream(
    request: web.Request,
    state: SimState,
    parsed: GenerationRequest,
    plans: tuple[SequencePlan, ...],
    meta: ResponseMeta,
    *,
    chat: bool,
) -> web.StreamResponse:
    """Write each token as its own SSE event the moment the engine produces it.

    Nothing is buffered: ``StreamResponse.write`` hands every event to the transport, and the
    response is chunked with no compression, so proxies see tokens as they are generated.
    """
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    continuous = parsed.continuous_usage
    interval = state.config.stream_interval
    engine = state.config.engine
    opened = False
    pending: dict[int, list[str]] = {}
    """Each sequence's tokens not yet sent (``stream_interval`` above 1)."""
    try:
        async with aclosing(state.engine.run(plans, parsed.priority)) as events:
            async for event in events:
                prompt_tokens = plans[event.seq].prompt_tokens
                chunks: list[dict[str, Any]] = []
                if chat and not opened:  # vLLM's first iteration: a role chunk per choice
                    opened = True
                    opening = Usage(prompt_tokens, 0) if continuous else None
                    chunks.extend(sse.chat_role_chunk(meta, opening, index)
                                  for index in range(len(plans)))
                texts = pending.setdefault(event.seq, [])
                texts.append(event.text)
                if len(texts) == interval or event.finish_reason is not None:
                    text = "".join(texts)
                    texts.clear()
                    usage = Usage(prompt_tokens, event.token + 1) if continuous else None
                    if chat:
                        chunks.append(sse.chat_token_chunk(meta, text, event.finish_reason, usage,
                                                           event.seq))
                    else:
                        chunks.append(
                            sse.completion_token_chunk(meta, event.seq, text, event.finish_reason, usage)
                        )
                if chunks:
                    await response.write(b"".join(sse.engine_event(chunk, engine)
                                                  for chunk in chunks))
        if parsed.include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            await response.write(sse.engine_event(
                sse.usage_chunk(meta, kind, usage_of(plans, parsed.n)), engine))
        await response.write(sse.DONE)
        await response.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; the engine has already counted the abort.
        pass
    return response
