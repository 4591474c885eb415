"""A stream state driven as the service drives it, keeping what the service hands telemetry.

The core reports nothing itself: its answers carry what happened (a route chosen, a client
error answered, a request ended) and ``close`` returns an aborted request's record. The service
(:meth:`extproc.adapters.service.ExternalProcessor.Process`) hands those to telemetry with
:func:`extproc.telemetry.events.emit`; :class:`Served` does the same, so a test reads what a
stream reports as the service would emit it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from extproc.actions import Action, Continue, Found, Lookup, Phase, RateCheck, Reply, Step, Verdict
from extproc.records import Rejection, RequestRecord, RouteChosen
from extproc.stream import StreamState
from extproc.telemetry.events import NullTelemetry, Telemetry, emit

S = TypeVar("S", bound=Step)


class Recorder(NullTelemetry):
    """Keeps every report in order of arrival; phase timings are no-ops."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.routes: list[RouteChosen] = []
        self.rejections: list[Rejection] = []

    def request_done(self, record: RequestRecord) -> None:
        self.records.append(record)

    def routed(self, model: str, cluster: str, variant: str) -> None:
        self.routes.append(RouteChosen(model, cluster, variant))

    def rejected(self, status: int, code: str) -> None:
        self.rejections.append(Rejection(status, code))


class Served:
    """``state`` with every answer's reports, and ``close``'s record, handed to ``telemetry``
    as the service hands them."""

    def __init__(self, state: StreamState, telemetry: Telemetry | None = None) -> None:
        self.state = state
        self.telemetry: Telemetry = telemetry if telemetry is not None else Recorder()

    def handle(self, phase: Phase, headers: Mapping[str, str] | None, body: bytes,
               end_of_stream: bool) -> Step:
        return self._emitted(self.state.handle(phase, headers, body, end_of_stream))

    def resume(self, lookup: Lookup, found: Found) -> Step:
        return self._emitted(self.state.resume(lookup, found))

    def admit(self, check: RateCheck, verdict: Verdict) -> Action:
        return self._emitted(self.state.admit(check, verdict))

    def close(self) -> None:
        record = self.state.close()
        if record is not None:
            self.telemetry.request_done(record)

    def _emitted(self, step: S) -> S:
        # The service emits only answers: a Lookup or RateCheck is I/O to do first.
        if isinstance(step, Continue | Reply):
            emit(self.telemetry, step)
        return step
