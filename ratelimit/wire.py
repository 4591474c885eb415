"""Envoy RLS v3 protobuf to plain types and back; the one module that builds the messages.

On OVER_LIMIT the response carries ``retry-after`` (whole seconds, at least 1),
``content-type: application/json`` and an OpenAI-shaped ``raw_body`` that Envoy sends as the
429 body::

    {"error": {"message": "Rate limit reached for requests per api_key: limit 10 per second.
     Please retry after 3 seconds.", "type": "requests", "param": null,
     "code": "rate_limit_exceeded"}}

``type`` is ``requests``, ``tokens`` or ``concurrent`` (which kind ran out). A reservation
larger than a bucket can ever hold gets a message giving both numbers, no ``retry-after`` (no
wait would help) and ``x-should-retry: false`` (the openai SDK then does not retry). When the
store failed and the domain says ``on_backend_error: deny``, the body is ``server_error`` /
``upstream_unavailable``.

Every decided response (OK or not) also carries OpenAI's header names for the tightest bucket
of each kind (``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-tokens``, ...), which
Envoy adds to the client's response; the IETF draft headers Envoy builds from the descriptor
statuses never show ``remaining`` above ``limit``.

Descriptor entries named in :data:`sidecar_runtime.wire_names.CONTROL_ENTRIES` (the request's lease,
the tokens its response used, a slot release) are taken out here, before any matching.
"""

from __future__ import annotations

import math
import re

import orjson
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from envoy.type.v3 import ratelimit_unit_pb2

from ratelimit.descriptors import CONCURRENT, REQUESTS, TOKENS, UNIT_SECONDS, Limit
from ratelimit.limiter import (
    UNLIMITED_REMAINING,
    DescriptorOutcome,
    DescriptorRequest,
    LimitOutcome,
    LimitRequest,
    Override,
    Phase,
)
from sidecar_runtime.wire_names import CONTROL_ENTRIES, LEASE_ENTRY, RELEASE_ENTRY, USED_ENTRY

_Response = rls_pb2.RateLimitResponse
_UNITS = {
    "second": _Response.RateLimit.SECOND,
    "minute": _Response.RateLimit.MINUTE,
    "hour": _Response.RateLimit.HOUR,
    "day": _Response.RateLimit.DAY,
    "week": _Response.RateLimit.WEEK,
    "month": _Response.RateLimit.MONTH,
    "year": _Response.RateLimit.YEAR,
}
_OVERRIDE_UNITS = {
    value: name.lower()
    for name, value in ratelimit_unit_pb2.RateLimitUnit.items()
    if name.lower() in UNIT_SECONDS
}
_PLAIN_UNITS = ("second", "minute", "hour", "day", "week", "year")
MAX_DESCRIPTORS = 1024
"""Descriptors one ``ShouldRateLimit`` call may carry: Envoy's calls carry a few, a batch of
settlements from extproc (:mod:`extproc.settlements`) at most 256; the service refuses more."""
_LEASE = re.compile(r"^[0-9A-Za-z_-]{8,64}$")
_USED = re.compile(r"^[0-9]{1,16}$")


def request_from_proto(message: rls_pb2.RateLimitRequest) -> LimitRequest:
    return LimitRequest(
        domain=message.domain,
        descriptors=tuple([_descriptor(d) for d in message.descriptors]),
        hits_addend=message.hits_addend,
    )


BACKEND_DENY_HEADER = "x-llm-ratelimit-backend"


def _descriptor(message: ratelimit_pb2.RateLimitDescriptor) -> DescriptorRequest:
    # One pass over the entries, control entries read and left out as they come: every entry
    # read from upb costs a wrapper object, and a settlement batch carries 60 descriptors of
    # five entries (bench.ratelimit_python). A later lease or used entry wins, as before.
    entries: list[tuple[str, str]] = []
    lease: str | None = None
    phase: Phase = "admit"
    used: int | None = None
    for entry in message.entries:
        key = entry.key
        if key not in CONTROL_ENTRIES:
            entries.append((key, entry.value))
        elif key == LEASE_ENTRY:
            value = entry.value
            lease = value if _LEASE.match(value) else None
        elif key == USED_ENTRY:
            value = entry.value
            phase = "settle"
            used = int(value) if _USED.match(value) else None
        elif key == RELEASE_ENTRY and phase == "admit":
            phase = "release"
    hits = message.hits_addend.value if message.HasField("hits_addend") else None
    override = None
    if message.HasField("limit"):
        unit = _OVERRIDE_UNITS.get(message.limit.unit)
        if unit is not None:
            override = Override(message.limit.requests_per_unit, unit)
    return DescriptorRequest(tuple(entries), hits, override, lease, phase, used)


def current_limit(limit: Limit) -> tuple[int, str]:
    """``(requests_per_unit, unit)`` as Envoy can show it: a ``5m`` window is reported in the
    smallest plain unit where the rate is a whole number (100 per 5m: 20 per minute), else
    rounded per day."""
    if limit.unit_multiplier == 1:
        return limit.requests_per_unit, limit.unit
    window = limit.window_s
    for unit in _PLAIN_UNITS:
        scaled = limit.requests_per_unit * UNIT_SECONDS[unit]
        if scaled % window == 0 and scaled // window >= 1:
            return scaled // window, unit
    return max(1, round(limit.requests_per_unit * UNIT_SECONDS["day"] / window)), "day"


def response_to_proto(outcome: LimitOutcome) -> rls_pb2.RateLimitResponse:
    response = _Response(overall_code=_Response.OK if outcome.ok else _Response.OVER_LIMIT)
    add_status = response.statuses.add
    for status in outcome.statuses:
        _status(status, add_status())
    # Headers are added in place from their two strings: a HeaderValue built and appended is
    # copied, twice the cost (bench.ratelimit_python).
    add = response.response_headers_to_add.add
    for key, value in openai_headers(outcome.statuses):
        add(key=key, value=value)
    if not outcome.ok:
        if outcome.never:
            add(key="x-should-retry", value="false")
        else:
            add(key="retry-after", value=str(outcome.retry_after_s))
        add(key="content-type", value="application/json")
        if outcome.backend_failed:
            # Envoy's local-reply mapper turns a denial carrying this header into a 503: the
            # store being down is not the client's rate limit (README: Errors).
            add(key=BACKEND_DENY_HEADER, value="unavailable")
        response.raw_body = error_body(outcome)
    return response


def _status(status: DescriptorOutcome, out: rls_pb2.RateLimitResponse.DescriptorStatus) -> None:
    """Fill ``out`` (added in place: appending a built message would copy it)."""
    out.code = _Response.OK if status.code == "ok" else _Response.OVER_LIMIT
    ceiling = 2**32 - 1
    limit = status.limit
    if limit is not None and not limit.unlimited:
        rpu, unit = current_limit(limit)
        shown = out.current_limit
        shown.requests_per_unit = rpu
        shown.unit = _UNITS[unit]
        shown.name = limit.name
        # Envoy shows requests_per_unit as x-ratelimit-limit: a bucket whose burst is above
        # its rate must not show more remaining than that limit.
        ceiling = rpu
    if status.remaining is not None:
        out.limit_remaining = min(status.remaining, ceiling)
    if status.reset_s is not None:
        out.duration_until_reset.seconds = math.ceil(status.reset_s)


_HEADER_NAMES = {kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}",
                        f"x-ratelimit-reset-{kind}") for kind in (REQUESTS, TOKENS)}


def openai_headers(statuses: tuple[DescriptorOutcome, ...]) -> list[tuple[str, str]]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the bucket of each
    kind with the least left (limit: the bucket's capacity; reset: until it is full again); of
    equals, the first."""
    tight: dict[str, tuple[int, DescriptorOutcome]] = {}  # one pass: runs on every decision
    for status in statuses:
        remaining = status.remaining
        if remaining is None or remaining == UNLIMITED_REMAINING or status.limit is None:
            continue
        kind = status.kind
        if kind in _HEADER_NAMES:
            best = tight.get(kind)
            if best is None or remaining < best[0]:
                tight[kind] = (remaining, status)
    out: list[tuple[str, str]] = []
    for kind, (limit_name, remaining_name, reset_name) in _HEADER_NAMES.items():
        found = tight.get(kind)
        if found is None:
            continue
        remaining, status = found
        assert status.limit is not None
        capacity = status.limit.capacity
        out += [(limit_name, str(capacity)),
                (remaining_name, str(min(remaining, capacity))),
                (reset_name, _duration(status.reset_s or 0.0))]
    return out


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def error_body(outcome: LimitOutcome) -> bytes:
    """The OpenAI-shaped JSON body for a denied request; never contains descriptor values."""
    seconds = outcome.retry_after_s
    after = f"Please retry after {seconds} second{'s' if seconds != 1 else ''}."
    cause = outcome.cause
    if outcome.backend_failed:
        error = {
            "message": f"Rate limiting is unavailable and this gateway fails closed. {after}",
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        }
    elif outcome.never and cause is not None and cause.limit is not None:
        per = f" per {cause.level}" if cause.level != "other" else ""
        error = {
            "message": f"This request needs {outcome.needed} {cause.kind}, more than the "
                       f"{cause.kind} limit{per} can ever hold ({cause.limit.capacity}): it "
                       "cannot be admitted; lower max_tokens (or n), or shorten the prompt.",
            "type": cause.kind,
            "param": None,
            "code": "rate_limit_exceeded",
        }
    else:
        kind = cause.kind if cause is not None else "requests"
        error = {
            "message": f"{_reached(cause, kind)} {after}",
            "type": kind,
            "param": None,
            "code": "rate_limit_exceeded",
        }
    return orjson.dumps({"error": error})


def _reached(cause: DescriptorOutcome | None, kind: str) -> str:
    if cause is None or cause.limit is None:
        return f"Rate limit reached for {kind}."
    per = f" per {cause.level}" if cause.level != "other" else ""
    limit = cause.limit
    if kind == CONCURRENT:
        return f"Concurrency limit reached{per}: at most {limit.concurrent} requests in flight."
    window = limit.unit if limit.unit_multiplier == 1 else f"{limit.unit_multiplier} {limit.unit}s"
    return f"Rate limit reached for {kind}{per}: limit {limit.requests_per_unit} per {window}."
