"""What a stream reports about its request, as plain frozen values (telemetry consumes them).

The core builds these and returns them on its answers (:mod:`extproc.actions`) or from
:meth:`extproc.stream.StreamState.close`; only the service hands them to a
:class:`extproc.telemetry.events.Telemetry` (:func:`extproc.telemetry.events.emit`), so deciding
an answer has no telemetry side effect and the core needs no telemetry object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extproc.quick_init import quick_init

Outcome = Literal["ok", "error", "client_error", "rate_limited", "aborted"]
"""How a request ended: the ``outcome`` of its log line and metric labels (a fixed set)."""


@quick_init
@dataclass(frozen=True)
class RequestRecord:
    """One routed request (chat, completions or embeddings) as the gateway saw it end.

    Exactly one per request that was routed: at the end of its response, or, when the ext_proc
    stream ends before that (the client hung up, the upstream reset), with ``aborted``.
    """

    request_id: str
    model: str
    cluster: str
    variant: str
    tenant: str
    status: int
    streamed: bool
    errored: bool
    """5xx, or an error body/event (a vLLM 400's included): see
    :func:`extproc.canary.guard.canary_error` for what the canary guard counts."""
    duration_s: float
    ttft_s: float | None
    """Request start to the first content chunk (streamed responses only): the prefill side."""
    tpot_s: float | None
    """Mean time between content chunks after the first: the decode side."""
    prompt_tokens: int
    completion_tokens: int
    """From the response's ``usage``, else the content chunks streamed so far."""
    charged_tokens: int | None
    """Tokens extproc handed the rate limiter at the end; None when the response never ended
    (aborted): extproc settled nothing, and what was reserved at admission stands."""
    aborted: bool = False
    """The ext_proc stream ended before the response did."""
    cache: str | None = None
    """Embeddings with a cache: hit, partial, miss or bypass."""
    limited: bool = False
    """The gateway's rate limiter answered (429, or 503 with its store down): no pool saw it."""
    sampled: bool = True
    """extproc read the response. False: recorded at the response headers (``telemetry.sample``),
    so ``duration_s`` is time to headers and there are no TTFT, TPOT or token counts."""
    queued_s: float | None = None
    """Seconds it waited in extproc for a pod with room (flow control); None: it did not wait.
    ``duration_s`` includes the wait, ``ttft_s`` does not (it counts from the send)."""
    by_floor: bool = False
    """Read only because the model had reads left under ``telemetry.sample_min_per_s`` this
    second: in the metrics, not in the canary guard's windows. The floor takes the first
    requests of each second, so which stable requests it reads depends on the load (all in a
    quiet second, few in a busy one); counted by the guard, they would weight quiet seconds
    over busy ones on the stable side only (every canary request is read), and bias the error
    ratio and p99 TTFT it compares. The share's reads are a uniform sample of request ids."""


def outcome(record: RequestRecord) -> Outcome:
    """The one place a record's outcome is decided (log line and metrics agree)."""
    if record.aborted:
        return "aborted"
    status = record.status
    if status >= 500 or (record.errored and status < 400):
        return "error"
    if status == 429:
        return "rate_limited"
    if status >= 400:
        return "client_error"
    return "ok"


@dataclass(frozen=True, slots=True)
class RouteChosen:
    """A request was sent to a pool: the answer that routes it carries this (a routing
    decision counted once, whatever becomes of the request)."""

    model: str
    cluster: str
    variant: str


@dataclass(frozen=True, slots=True)
class Rejection:
    """extproc answered a client error itself (the status and OpenAI ``code`` of its reply)."""

    status: int
    code: str
