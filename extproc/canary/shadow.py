"""Shadow requests: a finished stable answer replayed on the canary, the pair compared, the
verdict kept (docs: Canary verdict).

A shadow goes from extproc straight to a pod of the canary's pool, never through Envoy: no
client header goes with it (the pool's own ``upstream_api_key_env`` key when it has one), no
rate limit is charged for it, and the client never sees it. Shadows are bounded by their own
budget per extproc process (``max_shadows_per_s``, ``max_in_flight``) and skipped while the
canary pool has no room (a picker pool whose every pod is busy, or requests waiting for one).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable

import aiohttp

from extproc.actions import ShadowJob
from extproc.canary.guard import CanaryGuards
from extproc.canary.rouge import RougeProcess
from extproc.canary.text import AnswerText
from extproc.canary.verdict import Pair, PairMetrics, judge
from extproc.context import EndpointPicking
from routing.compiled import Snapshot
from sidecar_runtime.h2grpc.limits import Budget, Rate
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.canary.shadow")
JUDGE_EVERY_S = 1.0


class ShadowRunner:
    """Runs the shadows the answers hand over (:meth:`submit`), on the event loop."""

    def __init__(self, snapshot: Callable[[], Snapshot], guards: CanaryGuards,
                 metrics: PairMetrics, picker: EndpointPicking | None = None,
                 on_stopped: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._snapshot = snapshot
        self._guards = guards
        self._metrics = metrics
        self._picker = picker
        self._on_stopped = on_stopped
        self._clock = clock
        self._budgets: dict[str, tuple[float, Budget]] = {}
        """Per model: ``max_shadows_per_s`` and its token bucket (as many at once at most)."""
        self._open: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._turns: dict[str, itertools.count[int]] = {}
        self._rouge = RougeProcess()
        self._judged_at: dict[str, float] = {}

    def submit(self, job: ShadowJob) -> None:
        """Start ``job``'s shadow, or count why it is skipped. Never raises, never waits."""
        spec = job.canary.compare
        if spec is None:
            return
        model, cluster = job.model, job.canary.cluster
        if self._open.get(model, 0) >= spec.max_in_flight:
            self._metrics.shadows.labels(model, "skipped_busy").inc()
            return
        picker = self._picker
        if picker is not None and picker.must_wait(cluster):
            self._metrics.shadows.labels(model, "skipped_saturated").inc()
            return
        rate = spec.max_shadows_per_s
        held = self._budgets.get(model)
        if held is None or held[0] != rate:  # a reload with another rate starts a new bucket
            held = self._budgets[model] = (rate, Budget(Rate(max(1.0, rate), rate)))
        if not held[1].spend():
            self._metrics.shadows.labels(model, "skipped_budget").inc()
            return
        self._open[model] = self._open.get(model, 0) + 1
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job: ShadowJob) -> None:
        model = job.model
        try:
            pair = await self._shadow(job)
        except Exception as exc:  # a failed shadow is a skipped pair, never an error
            log.info("canary_shadow_failed", model=model, error=type(exc).__name__)
            pair = None
        finally:
            self._open[model] -= 1
        if pair is None:
            self._metrics.shadows.labels(model, "failed").inc()
            return
        self._metrics.shadows.labels(model, "compared").inc()
        self._metrics.add(pair)
        try:
            self._judge(job)
        except Exception:
            log.exception("extproc_internal_error", where="canary verdict", model=model)

    def _judge(self, job: ShadowJob) -> None:
        """Judge the model's pairs again: after each pair until ``min_samples``, then at most
        once a second (:data:`JUDGE_EVERY_S`: the bootstrap costs 1 to 3 ms on the event loop)."""
        spec = job.canary.compare
        assert spec is not None
        stats = self._metrics.stats(job.model)
        now = self._clock()
        if stats.pairs > spec.min_samples \
                and now - self._judged_at.get(job.model, -JUDGE_EVERY_S) < JUDGE_EVERY_S:
            return
        self._judged_at[job.model] = now
        judgement = judge(stats, spec)
        self._metrics.show(job.model, judgement, spec)
        if judgement.verdict != "rollback" or spec.action != "rollback":
            return
        current = self._snapshot().models.get(job.model)
        if current is None or current.canary != job.canary:
            return  # the config changed meanwhile: its canary starts afresh
        reason = "canary verdict: " + "; ".join(judgement.reasons)
        if self._guards.stop(job.model, job.canary, reason) and self._on_stopped is not None:
            self._on_stopped(job.model)

    async def _shadow(self, job: ShadowJob) -> Pair | None:
        """Send the shadow and compare its answer; None when it failed."""
        cluster = self._snapshot().config.clusters.get(job.canary.cluster)
        spec = job.canary.compare
        if cluster is None or spec is None:
            return None
        picked = None
        if self._picker is not None and cluster.endpoint_picker is not None:
            pick = self._picker.pick(job.canary.cluster, job.prompt, "low", room_only=True)
            if pick is not None and pick.endpoint is not None:
                picked = pick.endpoint
        endpoint = picked or self._next(job.canary.cluster, cluster.endpoints)
        headers = {"content-type": "application/json"}
        key_env = cluster.upstream_api_key_env
        if key_env is not None and os.environ.get(key_env):
            headers["authorization"] = f"Bearer {os.environ[key_env]}"
        answer = AnswerText(streamed=True)
        session = self._client()
        started = self._clock()
        first = last = None
        try:
            async with session.post(f"http://{endpoint}{job.path}", data=job.body,
                                    headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=spec.timeout_s)) as resp:
                if resp.status != 200:
                    return None
                async for chunk in resp.content.iter_any():
                    answer.feed(chunk)
                    if answer.chars:
                        last = self._clock()
                        if first is None:
                            first = last
        finally:
            if picked is not None and self._picker is not None:
                self._picker.done(job.canary.cluster, picked)
        answer.finish()
        if answer.broken or not answer.text or first is None or last is None:
            return None
        tokens = answer.completion_tokens or 0
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        score = await self._rouge.score(job.stable_text, answer.text)
        return Pair(job.model, score, (job.stable_ttft_s, first - started if job.stable_ttft_s
                                       is not None else None),
                    (job.stable_tpot_s, tpot if job.stable_tpot_s is not None else None),
                    (job.stable_cost, cluster.cost_of(tokens)))

    def _next(self, cluster: str, endpoints: list[str]) -> str:
        turn = self._turns.setdefault(cluster, itertools.count())
        return endpoints[next(turn) % len(endpoints)]

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                headers={"User-Agent": "llm-sidecar-shadow"})
        return self._session

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._rouge.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None
