"""The canary guard: per model, stop sending traffic to a canary that is clearly worse.

Each extproc replica judges from what it saw itself (rolling windows of the last requests per
variant). Once tripped, the canary's share is 0 until its ``canary:`` config changes; a reload
that leaves it as it was keeps the guard's verdict. The workers of one replica (``--workers``)
share their verdicts through a folder of their supervisor's: a trip in one stops the canary in
all of them within a poll, and a worker restarted later starts with it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Gauge

from extproc.canary.policy import OPEN_CANARIES, CanaryPolicy
from extproc.records import RequestRecord
from extproc.telemetry.events import ForwardingTelemetry, Telemetry
from routing.compiled import Canary, ModelRoute, Snapshot
from routing.schema import GuardSpec
from sidecar_runtime.process.files import replace_file
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.canary.guard")
CANARY_TRIPS = "canary-trips"
"""The folder, in a ``--workers`` supervisor's, where its workers share tripped guards."""
WINDOW = 2000
ERROR_FLOOR = 0.01


def canary_error(record: RequestRecord) -> bool:
    """Is this request a failure of the pool that served it? Pure.

    Only what a client cannot cause on purpose counts: a 5xx (vLLM's own, or Envoy's for a
    pool it could not reach or that reset before answering) and an error a 2xx response
    carried (an error event mid-stream). A 4xx never counts, nor anything the gateway's rate
    limiter answered: a client sending bad requests or too many of them would otherwise stop
    the canary for everyone.
    """
    if record.limited or 400 <= record.status < 500:
        return False
    return record.status >= 500 or record.errored


def p99(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class Window:
    """The last ``WINDOW`` finished requests of one variant."""

    errors: deque[bool] = field(default_factory=lambda: deque(maxlen=WINDOW))
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, record: RequestRecord) -> None:
        self.errors.append(canary_error(record))
        if record.ttft_s is not None:
            self.ttfts.append(record.ttft_s)

    @property
    def error_rate(self) -> float:
        return sum(self.errors) / len(self.errors) if self.errors else 0.0


def verdict(spec: GuardSpec, stable: Window, canary: Window) -> str | None:
    """Why the canary should stop, or None. Pure."""
    if len(stable.errors) < spec.min_samples or len(canary.errors) < spec.min_samples:
        return None
    limit = spec.max_error_ratio * max(stable.error_rate, ERROR_FLOOR)
    if canary.error_rate > limit:
        return (f"error rate {canary.error_rate:.3f} > {spec.max_error_ratio} x "
                f"stable's {stable.error_rate:.3f}")
    if len(stable.ttfts) >= spec.min_samples and len(canary.ttfts) >= spec.min_samples:
        c99, s99 = p99(canary.ttfts), p99(stable.ttfts)
        if c99 > spec.max_ttft_p99_ratio * s99:
            return f"p99 TTFT {c99:.3f}s > {spec.max_ttft_p99_ratio} x stable's {s99:.3f}s"
    return None


@dataclass
class _Guard:
    canary: Canary
    stable: Window = field(default_factory=Window)
    candidate: Window = field(default_factory=Window)
    tripped: str | None = None


class CanaryGuards:
    """Guards of every model with ``canary.guard``, keyed by (model, canary config).

    Fed finished requests (by :class:`GuardedTelemetry`); what they decide is published as
    :attr:`policy`, a new immutable value each time a guard trips, which streams read.
    """

    def __init__(self, shared: str | None = None) -> None:
        self._guards: dict[tuple[str, Canary], _Guard] = {}
        self.policy: CanaryPolicy = OPEN_CANARIES
        """The canaries in force: the one thing routing reads from the guards."""
        self._shared = shared
        """A folder the workers of one replica share: one file per tripped (model, canary)."""

    def effective(self, model: ModelRoute) -> Canary | None:
        """The canary to use for ``model`` now: None once its guard has tripped."""
        return self.policy.canary_for(model)

    def _publish(self) -> None:
        self.policy = CanaryPolicy(frozenset(key for key, g in self._guards.items() if g.tripped))

    def tripped(self) -> dict[str, str]:
        return {model: g.tripped for (model, _), g in self._guards.items() if g.tripped}

    def observe(self, snapshot: Snapshot, record: RequestRecord) -> str | None:
        """Count one finished request; the reason when this request trips a guard."""
        if not record.sampled or record.by_floor:
            # Unread: no mid-stream errors or TTFT known. Read for the floor: the first
            # requests of each second, which would weight quiet seconds over busy ones on the
            # stable side only (RequestRecord.by_floor). The guard compares the share's reads
            # and the canary's, as before the floor.
            return None
        if record.aborted:
            # A client that hangs up says nothing about the variant that served it, and
            # counting it as an error would let callers who drop streams stop a canary.
            return None
        model = snapshot.models.get(record.model)
        if model is None or model.canary is None or model.canary.guard is None:
            return None
        guard = self._guard(model.name, model.canary)
        if guard.tripped:
            return None
        (guard.candidate if record.variant == "canary" else guard.stable).add(record)
        reason = verdict(model.canary.guard, guard.stable, guard.candidate)
        if reason is not None:
            self._trip(model.name, guard, reason, "canary_guard_tripped")
        return reason

    def stop(self, model: str, canary: Canary, reason: str) -> bool:
        """Stop ``model``'s ``canary`` as a tripped guard does (the canary verdict's rollback):
        here, in the other workers, and after a restart while its config stays. False when it
        was stopped already."""
        guard = self._guard(model, canary)
        if guard.tripped:
            return False
        self._trip(model, guard, reason, "canary_rolled_back")
        return True

    def _guard(self, model: str, canary: Canary) -> _Guard:
        key = (model, canary)
        guard = self._guards.get(key)
        if guard is None:
            # A changed canary config starts over; forget guards of configs no longer in use.
            stale = [k for k in self._guards if k[0] == model]
            for old in stale:
                del self._guards[old]
                self._unshare(*old)  # a config that comes back later starts afresh
            guard = self._guards[key] = _Guard(canary)
            if stale:
                self._publish()
        return guard

    def _trip(self, model: str, guard: _Guard, reason: str, event: str) -> None:
        guard.tripped = reason
        self._publish()
        log.warning(event, model=model, canary=guard.canary.model, reason=reason)
        self._share(model, guard.canary, reason)

    def _share(self, model: str, canary: Canary, reason: str) -> None:
        if self._shared is None:
            return
        try:
            os.makedirs(self._shared, exist_ok=True)
            replace_file(os.path.join(self._shared, _trip_name(model, canary)), json.dumps(
                {"model": model, "canary": repr(canary), "reason": reason}).encode())
        except OSError as exc:
            log.warning("canary_guard_not_shared", model=model, error=str(exc))

    def _unshare(self, model: str, canary: Canary) -> None:
        if self._shared is not None:
            with contextlib.suppress(OSError):
                os.unlink(Path(self._shared, _trip_name(model, canary)))

    def sync(self, snapshot: Snapshot) -> list[str]:
        """Take the trips other workers shared for canaries still configured as they were;
        the models whose canary this stopped."""
        if self._shared is None or not os.path.isdir(self._shared):
            return []
        stopped: list[str] = []
        for model in snapshot.models.values():
            canary = model.canary
            if canary is None or (canary.guard is None and (
                    canary.compare is None or canary.compare.action != "rollback")):
                continue
            guard = self._guards.get((model.name, canary))
            if guard is not None and guard.tripped:
                continue
            try:
                shared = json.loads(Path(self._shared, _trip_name(model.name, canary)).read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(shared, dict) or shared.get("model") != model.name \
                    or shared.get("canary") != repr(canary) or "reason" not in shared:
                continue
            self._guards[(model.name, canary)] = _Guard(canary, tripped=str(shared["reason"]))
            stopped.append(model.name)
            log.warning("canary_guard_tripped", model=model.name, canary=canary.model,
                        reason=shared["reason"], by="another worker")
        if stopped:
            self._publish()
        return stopped


def _trip_name(model: str, canary: Canary) -> str:
    """The file of a tripped (model, canary config): any change to the config is another."""
    return "trip-" + hashlib.sha256(f"{model}\0{canary!r}".encode()).hexdigest()[:32] + ".json"


class GuardedTelemetry(ForwardingTelemetry):
    """Feeds finished requests to the guards, then hands every event to ``inner``. It only
    feeds them: routing reads the guards' :class:`CanaryPolicy`, never this."""

    def __init__(self, inner: Telemetry, guards: CanaryGuards,
                 snapshot: Callable[[], Snapshot], tripped_gauge: Gauge | None = None) -> None:
        super().__init__(inner)
        self.guards = guards
        self.snapshot = snapshot
        self.tripped_gauge = tripped_gauge

    def request_done(self, record: RequestRecord) -> None:
        if self.guards.observe(self.snapshot(), record) and self.tripped_gauge is not None:
            self.tripped_gauge.labels(record.model).set(1)
        self.inner.request_done(record)
