"""What extproc reports about each request, as plain values; metrics and logs consume them.

Processors call a :class:`Telemetry`; the Prometheus implementation is in :mod:`extproc.metrics`,
and tests use :class:`NullTelemetry` or a recording fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RequestRecord:
    """One finished chat/completions request as the gateway saw it."""

    request_id: str
    model: str
    cluster: str
    variant: str
    tenant: str
    status: int
    streamed: bool
    errored: bool
    """5xx, or an error body/event (a vLLM 400's included): see
    :func:`extproc.canary_guard.canary_error` for what the canary guard counts."""
    duration_s: float
    ttft_s: float | None
    """Request start to the first content chunk (streamed responses only): the prefill side."""
    tpot_s: float | None
    """Mean time between content chunks after the first: the decode side."""
    prompt_tokens: int
    completion_tokens: int
    charged_tokens: int
    limited: bool = False
    """The gateway's rate limiter answered (429, or 503 with its store down): no pool saw it."""


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
