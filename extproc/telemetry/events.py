"""Where what extproc reports goes: the :class:`Telemetry` interface, and :func:`emit`, which
hands it what an answer reports.

The core builds the reports as values (:mod:`extproc.records`) and returns them; the service
alone calls a :class:`Telemetry` (through :func:`emit`). The Prometheus implementation is in
:mod:`extproc.telemetry.metrics`, and tests use :class:`NullTelemetry` or a recording fake.
"""

from __future__ import annotations

from typing import Protocol

from extproc.actions import Action, Continue
from extproc.records import RequestRecord


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


def emit(telemetry: Telemetry, answer: Action) -> None:
    """Hand ``telemetry`` what ``answer`` reports: the route it chose, the client error it
    answers, the request it ends (in that order). Runs on every ext_proc message: three
    attribute reads when the answer reports nothing."""
    if isinstance(answer, Continue):
        if answer.route is not None:
            route = answer.route
            telemetry.routed(route.model, route.cluster, route.variant)
    elif answer.rejection is not None:
        telemetry.rejected(answer.rejection.status, answer.rejection.code)
    if answer.record is not None:
        telemetry.request_done(answer.record)
