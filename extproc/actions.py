"""What the stream state answers each ext_proc message with, as plain frozen values.

:mod:`extproc.adapters.ext_proc_pb` turns these into protobuf; nothing else in the package sees protobuf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from extproc.quick_init import quick_init
from extproc.records import Rejection, RequestRecord, RouteChosen
from routing.compiled import Canary
from routing.schema import ServicesTls

Phase = Literal["request_headers", "request_body", "request_trailers", "response_headers",
                "response_body"]
Headers = tuple[tuple[str, str], ...]
Metadata = Mapping[str, Any]
NO_METADATA: Metadata = MappingProxyType({})


def frozen_metadata(values: Mapping[str, Any]) -> Metadata:
    """``values`` as a read-only mapping that no later change to ``values`` reaches."""
    return values if type(values) is MappingProxyType else MappingProxyType(dict(values))


@quick_init
@dataclass(frozen=True)
class ModeOverride:
    """Processing-mode change for the rest of this stream (needs ``allow_mode_override``)."""

    response_headers: bool = True
    response_body: Literal["none", "streamed", "buffered"] = "none"


@quick_init
@dataclass(frozen=True)
class CacheWrite:
    """Embedding vectors to store once the answer carrying this is sent (it never waits for it)."""

    entries: tuple[tuple[str, bytes], ...]
    ttl_s: int


Descriptor = tuple[tuple[str, str], ...]
"""One rate-limit descriptor: its (key, value) entries in order."""


@quick_init
@dataclass(frozen=True)
class ShadowJob:
    """A finished stable answer to replay on the canary (docs: Canary verdict), once the answer
    carrying this is sent. The service hands it to the shadow runner, which never delays or
    changes the client's answer."""

    model: str
    """The stable model's name (what the verdict is labelled with)."""
    canary: Canary
    path: str
    """``/v1/chat/completions`` or ``/v1/completions``."""
    body: bytes
    """The request as stable's pool got it, for the canary's model, streamed with usage. No
    header of the client's goes with it."""
    prompt: bytes
    """What the canary pool's picker keys on (the first prompt's text)."""
    stable_text: str
    stable_ttft_s: float | None
    stable_tpot_s: float | None
    stable_cost: float
    """Stable's completion tokens, times its pool's ``cost_per_1k_tokens`` / 1000 when set."""


@quick_init
@dataclass(frozen=True)
class Settlement:
    """A finished request's token reservation, which extproc may settle itself (batched, see
    :mod:`extproc.settlements`) instead of leaving it to Envoy's stream-done call.

    ``descriptors`` are exactly the token descriptors that call would carry (level entries,
    lease, used tokens, done). The answer carrying this also carries Envoy's ``llm_done``: the
    service removes it when its batcher takes the settlement over, so exactly one of the two
    settles (docs: Rate limits)."""

    descriptors: tuple[Descriptor, ...]


@quick_init
@dataclass(frozen=True)
class Continue:
    """Let the message through, with optional header and body changes."""

    set_headers: Headers = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    clear_route_cache: bool = False
    mode: ModeOverride | None = None
    metadata: Metadata = field(default_factory=lambda: NO_METADATA)
    """Dynamic metadata to hand Envoy (for example LLM tokens to charge at stream end).
    Read-only: a dict given here is copied into a read-only view, so no answer (the shared
    :data:`PASS` least of all) can be changed after it is built."""
    store: CacheWrite | None = None
    settle: Settlement | None = None
    """The request's token settlement, when this answer ends a response whose usage is known."""
    lb_endpoints: tuple[str, ...] = ()
    """The pods (``ip:port``) picked for this request, best first: sent as the endpoint picker
    protocol's ``envoy.lb`` metadata and ``x-gateway-destination-endpoint`` header, which
    Envoy's override_host balancer follows in order (the next on a retry)."""
    route: RouteChosen | None = field(default=None, compare=False, repr=False)
    """The routing decision, when this answer sends the request to a pool."""
    shadow: ShadowJob | None = field(default=None, compare=False, repr=False)
    """A stable answer to replay on the canary, when this answer ends one chosen for it."""
    record: RequestRecord | None = field(default=None, compare=False, repr=False)
    """The request, when this answer ends it. What an answer reports (this, :attr:`route`) is
    handed to telemetry by the service (:func:`extproc.telemetry.events.emit`): neither the
    processor that built it nor the stream reports anything. Not part of the answer's value."""

    def __post_init__(self) -> None:
        if type(self.metadata) is not MappingProxyType:
            object.__setattr__(self, "metadata", frozen_metadata(self.metadata))


_CONTINUE_FIELDS = frozenset(Continue.__dataclass_fields__)


def evolve(action: Continue, **changes: Any) -> Continue:
    """``dataclasses.replace(action, **changes)`` in a fifth of its CPU (issue 16: twice on
    every routed request, ~3 µs each): the fields copied as they are, ``metadata`` made
    read-only as ``__post_init__`` makes it. An unknown field raises ``TypeError`` as
    ``replace`` does."""
    unknown = changes.keys() - _CONTINUE_FIELDS
    if unknown:
        raise TypeError(f"Continue has no field {sorted(unknown)}")
    if "metadata" in changes:
        changes["metadata"] = frozen_metadata(changes["metadata"])
    out = object.__new__(Continue)
    values = out.__dict__  # a frozen dataclass refuses setattr, not its __dict__
    values.update(action.__dict__)
    values.update(changes)
    return out


@quick_init
@dataclass(frozen=True)
class Reply:
    """Answer the client now (ImmediateResponse); nothing reaches the upstream."""

    status: int
    body: bytes
    headers: Headers = (("content-type", "application/json"),)
    details: str = ""
    record: RequestRecord | None = field(default=None, compare=False, repr=False)
    """The request, when this answer ends a routed one (see :attr:`Continue.record`)."""
    rejection: Rejection | None = field(default=None, compare=False, repr=False)
    """The client error this answers, when the stream turned one into this reply."""


Action = Continue | Reply

Found = tuple[bytes | None, ...] | None
"""A lookup's values in key order (None where absent); None as a whole: the store could not
answer in time, and the request bypasses the cache."""


@quick_init
@dataclass(frozen=True)
class Lookup:
    """Not an answer yet: the stream needs the cached values of ``keys`` first.

    The service fetches them and hands them to :meth:`extproc.stream.StreamState.resume`,
    which calls ``resume`` for the next step.
    """

    keys: tuple[str, ...]
    resume: Callable[[Found], Step]


@quick_init
@dataclass(frozen=True)
class LimitStatus:
    """One descriptor's status in a rate-limit answer (what Envoy's x-ratelimit-* read)."""

    requests_per_unit: int
    window_s: int
    """The unit in seconds; 0 for a unit Envoy does not name in its quota policy."""
    name: str
    remaining: int
    reset_s: int


@quick_init
@dataclass(frozen=True)
class Verdict:
    """The rate-limit service's answer: ``ok``; ``over_limit`` with the body and headers of
    its 429; or ``unavailable`` (no answer within the deadline, or an error)."""

    result: Literal["ok", "over_limit", "unavailable"]
    body: bytes = b""
    headers: Headers = ()
    statuses: tuple[LimitStatus, ...] = ()


@quick_init
@dataclass(frozen=True)
class RateCheck:
    """Not an answer yet: the rate-limit service must admit this request first (a request
    extproc answers itself, which Envoy's rate-limit filter never sees).

    The service asks ``target`` and hands the :class:`Verdict` to
    :meth:`extproc.stream.StreamState.admit`, which calls ``resume`` for the answer.
    """

    target: str
    domain: str
    descriptors: tuple[Descriptor, ...]
    timeout_s: float
    resume: Callable[[Verdict], Action]
    tls: ServicesTls | None = None
    """How Envoy reaches the services (``services.tls``); extproc reaches ratelimit the same way."""


@quick_init
@dataclass(frozen=True)
class Waited:
    """How a flow-controlled wait ended: released to ``pods`` (best first; empty: Envoy
    balances), or refused (``pods`` None) for ``reason`` (``max_wait``, ``max_queue``), after
    ``waited_s`` seconds."""

    pods: tuple[str, ...] | None
    waited_s: float
    reason: str = ""


@quick_init
@dataclass(frozen=True)
class Hold:
    """Not an answer yet: every pod of ``cluster`` is busy, and the request waits in extproc
    (docs: Flow control) in the band of its ``priority`` among its ``tenant``'s, its body of
    ``size`` bytes held meanwhile.

    The service queues it (:mod:`extproc.flow.control`); when a pod has room it calls ``pick``
    then and there (late binding: the pod the picker chooses at release) and hands the
    :class:`Waited` to :meth:`extproc.stream.StreamState.held`, which calls ``resume``."""

    cluster: str
    priority: str
    tenant: str
    size: int
    max_wait_s: float
    max_queue: int
    max_bytes: int
    fairness: Literal["tenant", "none"]
    pick: Callable[[], tuple[str, ...]]
    resume: Callable[[Waited], Step]


Step = Action | Lookup | RateCheck | Hold
"""What a stream returns for a message: an answer, or something to do before answering (a
cache lookup, a rate-limit check, a wait for a pod with room)."""

PASS = Continue()
