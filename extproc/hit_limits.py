"""Rate limits for requests extproc answers itself (an embeddings request wholly from the cache).

Envoy's rate-limit filter runs after ext_proc, so an ImmediateResponse never reaches it: extproc
asks the rate-limit service itself, with the domain and the request descriptors Envoy would
have built from the routed ``x-llm-*`` headers (read off :func:`routing.ratelimits
.route_rate_limits`, so the two cannot drift), and answers from the verdict as Envoy would.
Pure: the call itself is :mod:`extproc.adapters.rls_client`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from extproc.actions import Action, Descriptor, Headers, LimitStatus, RateCheck, Reply, Verdict
from extproc.errors import error_body
from routing.compiled import Snapshot
from routing.ratelimits import DOMAIN, LEVEL_HEADERS, limit_entries, route_rate_limits
from routing.schema import RoutingConfig
from sidecar_runtime.wire.names import RATELIMIT_BACKEND_HEADER

UNAVAILABLE_DETAILS = "ratelimit_unavailable"


T = TypeVar("T")


def once_per_config(build: Callable[[RoutingConfig], T]) -> Callable[[RoutingConfig], T]:
    """``build(config)``, made once for the config last asked about (a reload brings a new
    one): for what every cache hit or settlement would otherwise derive again."""
    last: list[tuple[RoutingConfig, T]] = []

    def get(config: RoutingConfig) -> T:
        if not last or last[0][0] is not config:
            last[:] = [(config, build(config))]
        return last[0][1]
    return get


@once_per_config
def _limit_levels(config: RoutingConfig) -> Mapping[tuple[str, str, str | None], bool]:
    """(kind, level, value or None for the level's default) → that limit enforces (it is not
    ``shadow``)."""
    return MappingProxyType({(entry.kind, entry.level, entry.value): not entry.shadow
                             for entry in limit_entries(config)})


def limit_applies(config: RoutingConfig, headers: Mapping[str, str], kind: str, *,
                  enforcing: bool) -> bool:
    """Does a ``kind`` limit of ``config`` apply to a request routed with ``headers`` (each
    level's value in its :data:`~routing.ratelimits.LEVEL_HEADERS` header, as Envoy's
    descriptors read it)? A level's override for the value applies when there is one (it
    inherits the default's fields), else the level's default. ``enforcing``: only a limit that
    is not ``shadow`` counts."""
    if config.rate_limits is None:
        return False
    table = _limit_levels(config)
    for level, header in LEVEL_HEADERS.items():
        value = headers.get(header)
        found = table.get((kind, level, value)) if value is not None else None
        if found is None:
            found = table.get((kind, level, None))
        if found is not None and (found or not enforcing):
            return True
    return False


@once_per_config
def route_limits(config: RoutingConfig) -> tuple[dict[str, Any], ...]:
    """:func:`routing.ratelimits.route_rate_limits` of ``config``: every cache hit and every
    settlement extproc makes reads them."""
    return tuple(route_rate_limits(config))


def request_descriptors(config: RoutingConfig, headers: Mapping[str, str]) -> tuple[Descriptor, ...]:
    """The descriptors Envoy sends for the ``kind=requests`` limits of a request whose headers
    (after extproc's mutations) are ``headers``.

    Token checks are left out: a request answered from the cache costs no tokens. As in Envoy,
    a descriptor whose header is absent is not sent.
    """
    out: list[Descriptor] = []
    for rate_limit in route_limits(config):
        if rate_limit.get("apply_on_stream_done") or not _requests_kind(rate_limit["actions"]):
            continue
        entries = descriptor_entries(rate_limit["actions"], headers)
        if entries is not None:
            out.append(entries)
    return tuple(out)


def _requests_kind(actions: list[dict[str, Any]]) -> bool:
    """Is this a ``kind=requests`` rate limit (token and concurrency ones carry metadata
    actions extproc has no reason to evaluate)?"""
    return any(action.get("generic_key") == {"descriptor_key": "kind", "descriptor_value": "requests"}
               for action in actions)


def descriptor_entries(actions: list[dict[str, Any]], headers: Mapping[str, str],
                       metadata: Mapping[str, str] | None = None) -> Descriptor | None:
    """The descriptor Envoy builds from one rate limit's ``actions``, or None when Envoy would
    send none (a header absent; a required metadata key absent or empty, as Envoy's
    ``metadata`` action treats an empty string). ``metadata``: extproc's own dynamic metadata
    in :data:`~sidecar_runtime.wire.names.METADATA_NAMESPACE` (None: metadata actions are an
    error)."""
    return evaluate(compile_actions(actions, metadata is not None), headers, metadata)


_GENERIC, _HEADER, _METADATA = 0, 1, 2
Step = tuple[int, str, str, bool]
"""One action, read once: (kind, descriptor key, its value / header name / metadata key, whether
an absent metadata key skips the entry)."""


def compile_actions(actions: list[dict[str, Any]], metadata: bool) -> tuple[Step, ...]:
    """``actions`` as :func:`evaluate` runs them; each settlement runs 3 rate limits' actions
    (read once per config: :mod:`extproc.settlements`). Raises ``ValueError`` for an action
    extproc cannot evaluate (a metadata action when ``metadata`` is false among them)."""
    steps: list[Step] = []
    for action in actions:
        if "generic_key" in action:
            key = action["generic_key"]
            steps.append((_GENERIC, key.get("descriptor_key", "generic_key"),
                          key["descriptor_value"], False))
        elif "request_headers" in action:
            spec = action["request_headers"]
            steps.append((_HEADER, spec["descriptor_key"], spec["header_name"], False))
        elif "metadata" in action and metadata:
            spec = action["metadata"]
            steps.append((_METADATA, spec["descriptor_key"], spec["metadata_key"]["path"][0]["key"],
                          bool(spec.get("skip_if_absent"))))
        else:
            raise ValueError(f"an Envoy rate-limit action extproc cannot evaluate: {action}")
    return tuple(steps)


def evaluate(steps: tuple[Step, ...], headers: Mapping[str, str],
             metadata: Mapping[str, str] | None) -> Descriptor | None:
    """The descriptor of compiled actions (see :func:`descriptor_entries`)."""
    entries: list[tuple[str, str]] = []
    for kind, key, name, skip in steps:
        if kind == _GENERIC:
            entries.append((key, name))
        elif kind == _HEADER:
            value = headers.get(name)
            if value is None:
                return None
            entries.append((key, value))
        else:
            found = metadata.get(name, "") if metadata is not None else ""
            if found:
                entries.append((key, found))
            elif not skip:
                return None
    return tuple(entries)


def hit_check(snapshot: Snapshot, headers: Headers,
              resume: Callable[[Verdict], Action]) -> RateCheck | None:
    """The check a cache hit must pass; None when no request limit applies to it."""
    config = snapshot.config
    if config.rate_limits is None:
        return None
    descriptors = request_descriptors(config, dict(headers))
    if not descriptors:
        return None
    return RateCheck(config.services.ratelimit, DOMAIN, descriptors,
                     config.services.ratelimit_timeout_s, resume, config.services.tls)


def answer(verdict: Verdict, admitted: Reply, deny_on_failure: bool) -> Reply:
    """What the client gets: ``admitted`` (with Envoy's x-ratelimit-* headers), the service's
    own 429 (body and headers as Envoy would send them for a request it limited), or, when
    the service did not answer, Envoy's failure policy: admit, or 503 ``upstream_unavailable``."""
    if verdict.result == "unavailable":
        if not deny_on_failure:
            return admitted
        return Reply(503, error_body("The model backend or a gateway service is unavailable "
                                     "(rate limiting did not answer).", "server_error",
                                     "upstream_unavailable"), details=UNAVAILABLE_DETAILS)
    limits = x_ratelimit_headers(verdict.statuses)
    if verdict.result == "ok":
        return Reply(admitted.status, admitted.body,
                     admitted.headers + _merge(verdict.headers, limits), admitted.details)
    # A denial because the store is down is not the client's rate limit: 503 (docs: Errors).
    status = 503 if any(name == RATELIMIT_BACKEND_HEADER for name, _ in verdict.headers) else 429
    return Reply(status, verdict.body, _merge(verdict.headers, limits),
                 details="request_rate_limited")


def _merge(first: Headers, second: Headers) -> Headers:
    names = {name for name, _ in second}
    return tuple((n, v) for n, v in first if n not in names) + second


def x_ratelimit_headers(statuses: tuple[LimitStatus, ...]) -> Headers:
    """``x-ratelimit-limit``/``-remaining``/``-reset`` as Envoy's ``DRAFT_VERSION_03`` writes
    them: the descriptor with the least remaining, and each limit's quota policy."""
    tightest: LimitStatus | None = None
    policy = ""
    for status in statuses:
        if tightest is None or status.remaining < tightest.remaining:
            tightest = status
        if status.window_s:
            policy += f", {status.requests_per_unit};w={status.window_s}"
            if status.name:
                policy += f';name="{status.name}"'
    if tightest is None:
        return ()
    return (("x-ratelimit-limit", f"{tightest.requests_per_unit}{policy}"),
            ("x-ratelimit-remaining", str(tightest.remaining)),
            ("x-ratelimit-reset", str(tightest.reset_s)))
