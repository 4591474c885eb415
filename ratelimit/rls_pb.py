"""Envoy RLS v3 protobuf to plain types and back; the one module that builds the messages.

The service writes its answers as bytes (:func:`response_bytes`) and reads requests from theirs
(:mod:`ratelimit.request_bytes`); :func:`response_to_proto` and :func:`request_from_proto` are
the upb readings those are held equal to, and what they fall back on for the unusual.

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

Descriptor entries named in :data:`sidecar_runtime.wire.names.CONTROL_ENTRIES` (the request's lease,
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
from sidecar_runtime.wire import pb_write
from sidecar_runtime.wire.names import (
    CONTROL_ENTRIES,
    LEASE_ENTRY,
    RATELIMIT_BACKEND_HEADER,
    RELEASE_ENTRY,
    USED_ENTRY,
)

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
LEASE_VALUE = re.compile(r"^[0-9A-Za-z_-]{8,64}$")
USED_VALUE = re.compile(r"^[0-9]{1,16}$")


def request_from_proto(message: rls_pb2.RateLimitRequest) -> LimitRequest:
    return LimitRequest(
        domain=message.domain,
        descriptors=tuple([_descriptor(d) for d in message.descriptors]),
        hits_addend=message.hits_addend,
    )


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
            lease = value if LEASE_VALUE.match(value) else None
        elif key == USED_ENTRY:
            value = entry.value
            phase = "settle"
            used = int(value) if USED_VALUE.match(value) else None
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
            # store being down is not the client's rate limit (docs: Errors).
            add(key=RATELIMIT_BACKEND_HEADER, value="unavailable")
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


_CODES = (b"\x08" + bytes((_Response.OK,)), b"\x08" + bytes((_Response.OVER_LIMIT,)))
"""``overall_code`` (field 1) of a response, and ``code`` (field 1) of a status: OK, OVER_LIMIT."""
MAX_KEPT = 4096
"""Limits, and apart headers, whose encoded bytes :func:`response_bytes` keeps (past this many,
afresh)."""
_limits: dict[int, tuple[Limit, bytes, int]] = {}
_headers: dict[tuple[str, str], bytes] = {}
_INT64 = 2**63
_SMALL = tuple(bytes((n,)) for n in range(0x80))
varint = pb_write.varint


class _Unusual(Exception):
    """A value :func:`response_bytes` leaves to upb (it writes it, or raises, as it does)."""


def response_bytes(outcome: LimitOutcome) -> bytes:
    """``response_to_proto(outcome).SerializeToString()``, the same bytes written by hand.

    upb built the answer of an admission (6 statuses, 6 headers) field by field in ~15 µs
    (bench.ratelimit_python). The parts that repeat are kept encoded: per limit, a status's
    code and ``current_limit``; per (name, value), a header. The fields go in number order,
    proto3 zeros left out, a present empty message written empty: as upb writes them (the
    tests hold the bytes equal). A value upb would write differently or refuse (a reset above
    int64, a negative one) goes through upb."""
    try:
        return _response_bytes(outcome)
    except _Unusual:
        raw: bytes = response_to_proto(outcome).SerializeToString()
        return raw


def _response_bytes(outcome: LimitOutcome) -> bytes:
    ok = outcome.ok
    parts = [_CODES[0] if ok else _CODES[1]]
    field = pb_write.field
    for status in outcome.statuses:
        parts.append(_status_bytes(status))
    headers = _headers
    pairs = openai_headers(outcome.statuses)
    if not ok:
        if outcome.never:
            pairs.append(("x-should-retry", "false"))
        else:
            pairs.append(("retry-after", str(outcome.retry_after_s)))
        pairs.append(("content-type", "application/json"))
        if outcome.backend_failed:
            pairs.append((RATELIMIT_BACKEND_HEADER, "unavailable"))
    for pair in pairs:
        found = headers.get(pair)
        if found is None:
            if len(headers) >= MAX_KEPT:
                headers.clear()
            found = headers[pair] = field(
                3, pb_write.string(1, pair[0]) + pb_write.string(2, pair[1]))
        parts.append(found)
    if not ok:
        parts.append(pb_write.blob(5, error_body(outcome)))
    return b"".join(parts)


def _status_bytes(status: DescriptorOutcome) -> bytes:
    """As :func:`_status` fills a ``DescriptorStatus``: the status field (2) of the response.
    Per status on every decision, so written out flat (each call and varint costs)."""
    limit = status.limit
    body = _CODES[0] if status.code == "ok" else _CODES[1]
    ceiling = 2**32 - 1
    if limit is not None and not limit.unlimited:
        found = _limits.get(id(limit))
        if found is None or found[0] is not limit:
            if len(_limits) >= MAX_KEPT:
                _limits.clear()
            found = _limits[id(limit)] = (limit, *_current_limit(limit))
        body += found[1]
        ceiling = found[2]
    remaining = status.remaining
    if remaining is not None:
        if remaining > ceiling:
            remaining = ceiling
        if remaining:
            if remaining < 0:
                raise _Unusual  # upb refuses it
            body += b"\x18" + (_SMALL[remaining] if remaining < 0x80 else varint(remaining))
    reset_s = status.reset_s
    if reset_s is not None:
        seconds = math.ceil(reset_s)
        if seconds == 0:
            body += b"\x22\x00"  # present, empty
        elif 0 < seconds < 0x80:
            body += b"\x22\x02\x08" + _SMALL[seconds]
        elif 0 < seconds < _INT64:
            duration = b"\x08" + varint(seconds)
            body += b"\x22" + _SMALL[len(duration)] + duration
        else:
            raise _Unusual
    size = len(body)
    return b"\x12" + (_SMALL[size] if size < 0x80 else varint(size)) + body


def _current_limit(limit: Limit) -> tuple[bytes, int]:
    """``current_limit`` (field 2 of a status) as :func:`_status` fills it, and the ceiling of
    what the status shows as remaining."""
    rpu, unit = current_limit(limit)
    if not 0 <= rpu < 2**32:
        raise _Unusual
    body = (pb_write.varint(0x08) + pb_write.varint(rpu) if rpu else b"") \
        + (b"\x10" + pb_write.varint(_UNITS[unit]) if _UNITS[unit] else b"") \
        + pb_write.string(3, limit.name)
    return pb_write.field(2, body), rpu


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
