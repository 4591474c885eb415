"""One JSON log line per finished request (issue: logs that follow one request).

The line carries the ``x-request-id`` Envoy generated, so it joins Envoy's access log and the
rate limiter's lines. It never carries the API key: only the key id and tenant.
"""

from __future__ import annotations

from extproc.records import RequestRecord, outcome
from extproc.telemetry.events import ForwardingTelemetry
from sidecar_runtime.process.logs import get_logger

log = get_logger("extproc.request")


class LoggedTelemetry(ForwardingTelemetry):
    """Logs each finished request, then hands every event to ``inner``."""

    def request_done(self, record: RequestRecord) -> None:
        log.info(
            "request_done", request_id=record.request_id, model=record.model,
            cluster=record.cluster, variant=record.variant, tenant=record.tenant,
            status=record.status, outcome=outcome(record), streamed=record.streamed,
            errored=record.errored, cache=record.cache,
            duration_ms=round(record.duration_s * 1000, 3),
            ttft_ms=None if record.ttft_s is None else round(record.ttft_s * 1000, 3),
            prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
            charged_tokens=record.charged_tokens, sampled=record.sampled,
            queued_ms=None if record.queued_s is None else round(record.queued_s * 1000, 3),
        )
        self.inner.request_done(record)
