"""The ext_proc gRPC service: receives messages, hands them to the stream state, sends answers,
and hands telemetry what the answers report (the stream state and processors report nothing).

Only this module (with :mod:`extproc.adapters.ext_proc_pb`) knows about gRPC and protobuf.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry, generate_latest

from extproc.actions import NO_METADATA, Continue, Hold, Lookup, Phase, Reply, Step, evolve
from extproc.adapters import ext_proc_pb
from extproc.adapters.rls_client import RateLimitClient
from extproc.cache.metrics import CacheMetrics
from extproc.cache.shielded import VectorCache, open_vector_cache
from extproc.cache.store import MemoryVectorStore
from extproc.canary.guard import CANARY_TRIPS, CanaryGuards, GuardedTelemetry
from extproc.canary.report import MIN_SAMPLES, render_all
from extproc.canary.shadow import ShadowRunner
from extproc.canary.verdict import PairMetrics, verdicts_text
from extproc.context import EndpointPicking
from extproc.picker.runtime import PickerRuntime
from extproc.sampling import ReadFloor
from extproc.settlements import SettlementBatcher
from extproc.stream import StreamState
from extproc.telemetry.envoy_drift import EnvoyDrift
from extproc.telemetry.events import NULL_TELEMETRY, Telemetry, emit
from extproc.telemetry.metrics import ExtprocMetrics, settlements_counter
from extproc.telemetry.request_log import LoggedTelemetry
from routing.compiled import Snapshot, compile_config
from routing.loader import load_config
from routing.render.envoy import bootstrap_fingerprint
from sidecar_runtime.h2grpc import Context, Server
from sidecar_runtime.process.key_audit import audit_key_id_secret
from sidecar_runtime.process.logs import get_logger
from sidecar_runtime.process.reload import Reloader
from sidecar_runtime.process.reload_metrics import ReloadMetrics
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.workers import LAST_GOOD_CONFIG, worker_file
from sidecar_runtime.redis.audit import audit_redis
from sidecar_runtime.wire.names import DONE_METADATA_KEY, TOKENS_METADATA_KEY

log = get_logger("extproc.adapters.service")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
_USAGE_KEYS = frozenset({TOKENS_METADATA_KEY, DONE_METADATA_KEY})
_ANSWERS = (Continue, Reply)
"""A step that is an answer (a tuple made once: ``Continue | Reply`` would build a union per
message)."""
LINGER_S = 2.0
"""How long a finished stream waits for Envoy to reset it before closing it itself."""


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One ``Process`` call per HTTP request; each gets its own :class:`StreamState`."""

    def __init__(self, snapshot: Callable[[], Snapshot], settings: Settings,
                 telemetry: Telemetry = NULL_TELEMETRY,
                 guards: CanaryGuards | None = None,
                 cache: VectorCache | None = None,
                 limits: RateLimitClient | None = None,
                 picker: EndpointPicking | None = None,
                 settlements: SettlementBatcher | None = None,
                 drift: EnvoyDrift | None = None,
                 shadows: ShadowRunner | None = None) -> None:
        self._snapshot = snapshot
        self._shadows = shadows
        self._on_stale = drift.observe if drift is not None else None
        self._settlements = settlements
        self._picker = picker
        self._secret = settings.key_id_secret.get_secret_value().encode()
        self._telemetry = telemetry
        self._guards = guards
        self._cache = cache if cache is not None else VectorCache(
            MemoryVectorStore(settings.cache_memory_bytes), settings.redis_timeout_ms / 1000,
            settings.cache_store_timeout_ms / 1000, settings.redis_breaker_cooldown_ms / 1000,
            CacheMetrics(CollectorRegistry()))
        self._limits = limits if limits is not None else RateLimitClient(CollectorRegistry())
        self._read_floor = ReadFloor()
        """``telemetry.sample_min_per_s`` of this process: each ``--workers`` process reads up
        to that many a second per model (docs: Telemetry sampling)."""

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Context
    ) -> AsyncIterator[pb.ProcessingResponse]:
        telemetry = self._telemetry
        clock = time.perf_counter
        state = StreamState(self._snapshot(), self._secret, guards=self._guards,
                            picker=self._picker, on_stale=self._on_stale,
                            read_floor=self._read_floor)
        responses_asked = False  # the filter config skips response messages unless asked
        try:
            async for request in request_iterator:
                started = clock()
                phase, headers, body, end = ext_proc_pb.read(request)
                if phase is None:
                    continue  # response trailers: not requested by our processing mode
                step = state.handle(phase, headers, body, end)
                while not isinstance(step, _ANSWERS):
                    if isinstance(step, Lookup):
                        step = state.resume(step, await self._cache.lookup(step.keys))
                    elif isinstance(step, Hold):
                        # Only a picker pool is flow-controlled: the picker holds its queue.
                        picker = self._picker
                        assert picker is not None
                        step = state.held(step, await picker.wait(step))
                        started = clock()  # the phase's time is extproc's, not the wait
                    else:
                        step = state.admit(step, await self._limits.check(step))
                try:  # free when nothing raises (3.11's zero-cost try)
                    emit(telemetry, step)
                except Exception:
                    # A fault in telemetry must not change or break the answer.
                    log.exception("extproc_internal_error", phase=phase, where="telemetry")
                if isinstance(step, Continue) and step.settle is not None:
                    step = self._settled(step)
                response = ext_proc_pb.build(phase, step)
                telemetry.phase(phase, clock() - started)
                if isinstance(step, Continue):
                    # Scheduled before the yield: code after it does not run if the stream
                    # ends here.
                    if step.store is not None:
                        self._cache.store_later(step.store)
                    if step.shadow is not None and self._shadows is not None:
                        self._shadows.submit(step.shadow)
                yield response
                if isinstance(step, Continue) and step.mode is not None:
                    responses_asked = (step.mode.response_headers
                                       or step.mode.response_body != "none")
                if _last_message(step, phase, end, responses_asked):
                    # Nothing more will come, and Envoy ends the stream by resetting it: wait
                    # here, reading nothing, for that reset (it cancels this wait) rather than
                    # send a status that races it. (Under grpcio this also avoided a native
                    # memory leak, grpc/grpc#43360: RSS +17 % over a 200,000-request soak.) A
                    # client that half-closes without a reset gets the status after it.
                    await asyncio.sleep(LINGER_S)
                    return
        finally:
            # However the stream ended: Envoy's reset after the last answer (the request was
            # recorded already, close returns nothing), or a reset before it (client gone,
            # upstream reset: the server cancels the call, at an await here with CancelledError
            # or, while an answer is being sent, at the yield with GeneratorExit): close returns
            # the request's aborted record.
            _record_aborted(telemetry, state)

    def _settled(self, step: Continue) -> Continue:
        """``step`` without the usage metadata Envoy settles from when the batcher took its
        settlement over, so Envoy sends no token descriptor for it (settled once); as it is
        otherwise. Both keys go: on a stream, Envoy's sse_to_metadata writes ``llm_done`` at
        its end whoever read it, and would complete the pair."""
        if self._settlements is None or step.settle is None \
                or not self._settlements.offer(step.settle):
            return step
        kept = {key: value for key, value in step.metadata.items() if key not in _USAGE_KEYS}
        # Read-only already (evolve would copy a dict into one); usually nothing is left.
        return evolve(step, settle=None, metadata=MappingProxyType(kept) if kept else NO_METADATA)


def _record_aborted(telemetry: Telemetry, state: StreamState) -> None:
    """Hand telemetry the record of a request whose stream ended before its response did;
    never raises (it runs in ``finally``, where an exception would replace the cancellation)."""
    record = state.close()
    if record is None:
        return
    try:
        telemetry.request_done(record)
    except Exception:
        log.exception("extproc_internal_error", phase="close", where="telemetry",
                      request_id=record.request_id)


def _last_message(step: Step, phase: Phase, end: bool, responses_asked: bool) -> bool:
    """Will Envoy send nothing more on this stream after this answer?"""
    if not isinstance(step, Continue):
        return True  # an immediate response ends the request
    if phase == "response_headers" and step.mode is not None and step.mode.response_body == "none":
        return True  # no response body asked for: Envoy sends nothing more
    if not end:
        return False
    return phase.startswith("response") or not responses_asked


def load_snapshot(path: str) -> Snapshot:
    """The routing YAML at ``path``, loaded and compiled (what a reload swaps in), with the
    fingerprint of the bootstrap it renders (:mod:`extproc.telemetry.envoy_drift`)."""
    config = load_config(path)
    return replace(compile_config(config), envoy_fingerprint=bootstrap_fingerprint(config))


class ExtprocService:
    """ext_proc's part of the process skeleton (:mod:`sidecar_runtime.process.service_process`): the
    routing config and its reloader, the servicer and the resources it uses (embedding cache,
    rate-limit client, endpoint picker), metrics and the ``/canary`` page.

    Built on the event loop (the picker reads its clock). Each stream reads
    ``reloader.current()`` once; the endpoint picker follows reloads.
    """

    name = "extproc"
    health_name = SERVICE_NAME
    max_message_bytes = 64 * 1024 * 1024  # a body message: up to Envoy's buffer limit

    def __init__(self, config_path: str, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self.reloader: Reloader[Snapshot] = Reloader(
            config_path, load_snapshot, settings.reload_interval_s,
            ReloadMetrics(self.registry, "extproc"),
            last_good=worker_file(settings.worker_dir, LAST_GOOD_CONFIG))
        self._settings = settings
        snapshot = self.reloader.current
        metrics = ExtprocMetrics(self.registry, lambda: snapshot().known_tenants)
        self._guards = CanaryGuards(worker_file(settings.worker_dir, CANARY_TRIPS))
        self._canary_tripped = metrics.canary_tripped
        self._telemetry = GuardedTelemetry(LoggedTelemetry(metrics), self._guards, snapshot,
                                           metrics.canary_tripped)
        self._sync_canaries()  # a worker restarted after a sibling's guard tripped
        self._syncing: asyncio.Task[None] | None = None
        audit_redis(settings.redis_url, settings.dev_mode, self.registry, "extproc")
        audit_key_id_secret(settings.key_id_secret, settings.dev_mode, self.registry)
        self._cache = open_vector_cache(settings, CacheMetrics(self.registry))
        self._limits = RateLimitClient(self.registry)
        self._settlements = SettlementBatcher(
            lambda batch: self._limits.settle(snapshot().config.services, batch),
            settings.settle_batch_ms / 1000, settlements_counter(self.registry),
            settings.settle_batch_min)
        self._picker = PickerRuntime(snapshot().config, self.registry)
        self._shadows = ShadowRunner(snapshot, self._guards, PairMetrics(self.registry),
                                     self._picker, self._stopped_by_verdict)
        self._drift = EnvoyDrift(self.registry)
        self.reloader.subscribe(lambda fresh: self._picker.follow(fresh.config))
        self.ops_pages: Mapping[str, Callable[[Mapping[str, str]], str]] = {
            "/canary": lambda query: canary_page(self.registry, query)}

    def _stopped_by_verdict(self, model: str) -> None:
        self._canary_tripped.labels(model).set(1)

    def _sync_canaries(self) -> None:
        for model in self._guards.sync(self.reloader.current()):
            self._canary_tripped.labels(model).set(1)

    async def _sync_canaries_every(self, interval_s: float) -> None:
        """Other workers' canary verdicts, as often as the config is polled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self._sync_canaries()
            except Exception:  # a bad file must not end the polling
                log.exception("extproc_internal_error", where="canary guard sync")

    async def open(self, server: Server) -> None:
        await self._cache.connect()
        await self._picker.start()
        if self._settings.worker_dir is not None:
            self._syncing = asyncio.create_task(
                self._sync_canaries_every(self._settings.reload_interval_s))
        servicer = ExternalProcessor(self.reloader.current, self._settings, self._telemetry,
                                     self._guards, self._cache, self._limits, self._picker,
                                     self._settlements, self._drift, self._shadows)
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)

    async def close(self) -> None:
        if self._syncing is not None:
            self._syncing.cancel()
            await asyncio.gather(self._syncing, return_exceptions=True)
        await self._shadows.aclose()
        await self._settlements.aclose()  # the streams are done: send the last batch
        await self._cache.aclose()
        await self._limits.aclose()
        await self._picker.stop()

    def describe(self) -> Mapping[str, Any]:
        return {}


def canary_page(registry: CollectorRegistry, query: Mapping[str, str]) -> str:
    """``GET /canary[?min_samples=N]``: the canary comparison of this replica."""
    return canary_text(query, generate_latest(registry).decode())


def canary_text(query: Mapping[str, str], metrics_text: str) -> str:
    """The ``/canary`` page from a metrics text (one process's, or its workers' merged): the
    side-by-side comparison, then the shadow pairs' verdicts."""
    text = query.get("min_samples", str(MIN_SAMPLES))
    if not text.isdigit():
        raise ValueError("min_samples must be a whole number")
    page = render_all(metrics_text, int(text))
    verdicts = verdicts_text(metrics_text)
    return f"{page}\n\n{verdicts}" if verdicts else page
