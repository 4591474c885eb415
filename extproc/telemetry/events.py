"""What extproc reports about each request, as plain values; metrics and logs consume them.

Processors call a :class:`Telemetry`; the Prometheus implementation is in :mod:`extproc.telemetry.metrics`,
and tests use :class:`NullTelemetry` or a recording fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Outcome = Literal["ok", "error", "client_error", "rate_limited", "aborted"]
"""How a request ended: the ``outcome`` of its log line and metric labels (a fixed set)."""


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


class Telemetry(Protocol):
    def request_done(self, record: RequestRecord) -> None: ...
    def rejected(self, status: int, code: str) -> None: ...
    def routed(self, model: str, cluster: str, variant: str) -> None: ...
    def phase(self, phase: str, seconds: float) -> None: ...


class NullTelemetry:
    def request_done(self, record: RequestRecord) -> None:
        pass

    def rejected(self, status: int, code: str) -> None:
        pass

    def routed(self, model: str, cluster: str, variant: str) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        pass


NULL_TELEMETRY = NullTelemetry()


class ForwardingTelemetry:
    """Hands every event to ``inner``; decorators override what they add to."""

    def __init__(self, inner: Telemetry) -> None:
        self.inner = inner

    def request_done(self, record: RequestRecord) -> None:
        self.inner.request_done(record)

    def rejected(self, status: int, code: str) -> None:
        self.inner.rejected(status, code)

    def routed(self, model: str, cluster: str, variant: str) -> None:
        self.inner.routed(model, cluster, variant)

    def phase(self, phase: str, seconds: float) -> None:
        self.inner.phase(phase, seconds)
