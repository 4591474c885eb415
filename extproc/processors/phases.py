"""Where a routed request is in its ext_proc stream, as frozen phase values, and the transitions
between them as a table (as h11's ``_state.py``): a processor holds one phase, never a set of
optional attributes, and a message its phase does not expect is refused here, in one place.

A phase is frozen; what a phase accumulates message by message (a usage meter, a response
buffer, token timestamps) is a mutable accumulator it holds, so the hot path allocates no phase
per chunk. The tables are data: :mod:`tests.extproc.processors.test_phases` walks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from extproc.actions import Headers
from extproc.bodies import EmbeddingsBody
from extproc.cache.keys import KeyPlan
from extproc.cache.merge import Resolution
from extproc.canary.text import AnswerText
from extproc.decide import Decision
from extproc.quick_init import quick_init
from extproc.usage import UsageMeter, UsageStripper
from routing.compiled import CachePolicy, ModelRoute

Event = Literal["request_body", "lookup", "admitted", "response_headers", "response_body",
                "close"]
Table = Mapping[type, Mapping[Event, tuple[type, ...]]]
"""Phase type -> event -> the phase types that event may lead to (the same type: it stays)."""


P = TypeVar("P")


class TransitionError(Exception):
    """A message the request's phase does not expect: a bug here or in Envoy's side of the
    protocol. The stream logs it as an internal error and answers 500; it never crashes."""


def advance(table: Table, phase: object, event: Event, new: P) -> P:
    """``new``, when ``table`` lets ``phase`` go there on ``event``; else :class:`TransitionError`.

    Two dict lookups and a short tuple scan: nothing is allocated on the way.
    """
    leads_to = table.get(type(phase))
    if leads_to is None or type(new) not in leads_to.get(event, ()):
        raise TransitionError(f"{type(phase).__name__} --{event}--> {type(new).__name__} "
                              "is not a transition")
    return new


def refuse(phase: object, event: Event) -> TransitionError:
    """The error for an ``event`` that ``phase`` does not expect at all."""
    return TransitionError(f"{event} is not expected in {type(phase).__name__}")


@dataclass(frozen=True, slots=True)
class AwaitingBody:
    """Request headers let through; the body (model, prompt) is not known yet."""


@dataclass(frozen=True, slots=True)
class Done:
    """The request is recorded (or was never routed): nothing more to read or report."""


AWAITING_BODY = AwaitingBody()
DONE = Done()


# --- chat / completions ---------------------------------------------------------------------

@dataclass(slots=True)
class TokenTimes:
    """When the first and the latest content chunk of a streamed answer arrived (mutable: one
    update per chunk, no allocation)."""

    first: float | None = None
    last: float | None = None


@quick_init  # built per request: no slots, so its __init__ can be the quick one
@dataclass(frozen=True)
class Routed:
    """Sent upstream; no response yet."""

    decision: Decision
    model: str
    reads_body: bool
    """extproc reads the response (sampled, canary, or usage Envoy cannot read)."""
    lease: str = ""
    """The request's lease (its reservation in the ratelimit store)."""
    route: Headers = ()
    """The ``x-llm-*`` headers extproc routed it with (what its rate-limit descriptors hold)."""
    envoy_reads_usage: bool = False
    """The stream carries a usage chunk (the client's, or one extproc asked for) that Envoy's
    sse_to_metadata reads and settles with: extproc leaves the settlement to Envoy even when
    it reads the stream."""
    strip_usage: bool = False
    """extproc asked vLLM for a usage chunk the client did not, and no Envoy filter removes it:
    extproc takes it out of the chunks it passes (:class:`extproc.usage.UsageStripper`)."""
    sent_at: float | None = None
    """When extproc routed it (its body in hand): time to first token counts from here, so a
    client's own slow upload is not the pool's time (one slow body could trip, or mask, the
    canary guard's p99)."""
    by_floor: bool = False
    """Read only for ``telemetry.sample_min_per_s`` (:class:`extproc.sampling.ReadFloor`)."""
    queued_s: float | None = None
    """Seconds it waited for a pod with room (flow control); None: it did not wait."""
    shadow: bytes | None = None
    """The body to replay on the canary once the answer is complete (docs: Canary verdict);
    None: not chosen for a shadow."""


@quick_init  # built per request: no slots, so its __init__ can be the quick one
@dataclass(frozen=True)
class Reading:
    """The response is streaming through extproc, which meters it."""

    routed: Routed
    status: int
    streamed: bool
    limited: bool
    """The gateway's rate limiter answered (429, or 503 with its store down)."""
    meter: UsageMeter
    times: TokenTimes = field(default_factory=TokenTimes)
    stripper: UsageStripper | None = None
    """Set when ``routed.strip_usage`` and the answer streams."""
    answer: AnswerText | None = None
    """The answer's text, collected when ``routed.shadow`` is set."""


GenerationPhase = AwaitingBody | Routed | Reading | Done
GENERATION: Table = {
    # Response headers before the body: Envoy answered itself (its 413 for a body above its
    # buffer limit); the request never reached a pool.
    AwaitingBody: {"request_body": (Routed,), "response_headers": (Done,), "close": (Done,)},
    # A body without headers is read as a non-streamed answer of status 0 (as it always was).
    Routed: {"response_headers": (Reading, Done), "response_body": (Reading, Done),
             "close": (Done,)},
    Reading: {"response_body": (Reading, Done), "close": (Done,)},
    # After the end (``[DONE]`` seen, or a response recorded at its headers), later chunks pass.
    Done: {"response_body": (Done,), "close": (Done,)},
}


# --- embeddings -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Parsed:
    """An embeddings request read from its body and decided."""

    body: EmbeddingsBody
    model: ModelRoute
    decision: Decision
    counts: tuple[int, ...]
    """The counted tokens of each input, in input order."""


@dataclass(frozen=True, slots=True)
class Looking:
    """Waiting for the cache's values of the inputs' keys."""

    parsed: Parsed
    plan: KeyPlan
    policy: CachePolicy


@dataclass(frozen=True, slots=True)
class Admitting:
    """Every input cached: waiting for the rate limiter to admit the answer extproc gives."""

    parsed: Parsed
    resolution: Resolution


CacheResult = Literal["hit", "partial", "miss", "bypass"]


@dataclass(frozen=True, slots=True)
class Forwarded:
    """Sent upstream (all inputs, or the missing ones); no response yet."""

    parsed: Parsed
    outcome: CacheResult | None
    """None for a model without a cache."""
    reserved: int
    """The counted tokens of the inputs sent upstream: the request's reservation, and what is
    charged when vLLM's answer carries no usage."""
    sent: tuple[str, ...] = ()
    """The key of each input in the order it went upstream (vLLM's ``index`` points here)."""
    resolution: Resolution | None = None
    """A partial hit's cached and missing inputs (the merge needs them)."""
    policy: CachePolicy | None = None
    lease: str = ""
    """The request's lease (its reservation in the ratelimit store); set when it is sent."""
    route: Headers = ()
    """The ``x-llm-*`` headers extproc routed it with (what its rate-limit descriptors hold)."""


@dataclass(slots=True)
class ResponseBuffer:
    """vLLM's 200 answer so far (mutable: appended per chunk); emptied once it is too large."""

    data: bytearray = field(default_factory=bytearray)
    too_large: bool = False


@dataclass(frozen=True, slots=True)
class Buffering:
    """vLLM answered 200: its body is copied (and, for a partial hit, held back) to its end."""

    forwarded: Forwarded
    buffer: ResponseBuffer = field(default_factory=ResponseBuffer)


EmbeddingsPhase = AwaitingBody | Looking | Admitting | Forwarded | Buffering | Done
EMBEDDINGS: Table = {
    AwaitingBody: {"request_body": (Looking, Forwarded), "response_headers": (Done,),
                   "close": (Done,)},
    Looking: {"lookup": (Admitting, Forwarded), "close": (Done,)},
    Admitting: {"admitted": (Done,), "close": (Done,)},
    Forwarded: {"response_headers": (Buffering, Done), "close": (Done,)},
    Buffering: {"response_body": (Buffering, Done), "close": (Done,)},
    # An answer not read (an error status, skipped body): any chunk Envoy still sends passes.
    Done: {"response_body": (Done,), "close": (Done,)},
}
