"""Which chat/completions responses extproc reads, and which Envoy alone reads (issue 16).

Reading a response costs one ext_proc round trip per body chunk: per token on an SSE stream.
So extproc reads only a sampled share of stable traffic (for TTFT, time per output token, token
counts, mid-stream errors), all canary traffic (the canary comparison and guard need it), and
the responses whose usage Envoy cannot read for the rate limiter (non-streamed answers, vLLM's
running usage; see :mod:`routing.render.usage`). Pure functions on the parsed request, and
:class:`ReadFloor`, the one piece of state: up to ``telemetry.sample_min_per_s`` more a second
per model (issue 35), so a quiet gateway is measured in full.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from extproc.bodies import GenerationBody


def sampled(request_id: str, share: float) -> bool:
    """True for ``share`` of request ids. The id is Envoy's (a random UUID, never the client's),
    so a client cannot choose to be measured, or not."""
    if share >= 1:
        return True
    if share <= 0:
        return False
    hasher = _SAMPLE_HASH.copy()  # the parameter block set up once: 0.7 -> 0.4 µs
    hasher.update(request_id.encode())
    return int.from_bytes(hasher.digest(), "big") % 10_000 < round(share * 10_000)


_SAMPLE_HASH = hashlib.blake2b(digest_size=8, person=b"llm-sample")


def stable_share(sample: float, canary_percent: float | None) -> float:
    """The share of a model's stable requests extproc reads: ``telemetry.sample``, or, while
    the model has a canary, as many as the canary gets (every canary request is read), so the
    canary comparison and guard see about as many requests on each side."""
    if canary_percent is None or canary_percent <= 0:
        return sample
    if canary_percent >= 100:
        return 1.0
    return max(sample, min(1.0, canary_percent / (100 - canary_percent)))


class ReadFloor:
    """Reads left this second, per model: ``telemetry.sample_min_per_s`` of the stable
    responses nothing else has extproc read (the share, the canary, the rate limiter's usage).

    One per extproc process, shared by its streams. No lock: streams run on one event loop and
    :meth:`take` never awaits. No clock of its own: the caller passes the monotonic time it read
    for the request already (``sent_at``), and a model's count starts over when that crosses
    into another whole second. Models are the config's (bounded); one dropped by a reload keeps
    its two numbers.
    """

    __slots__ = ("_seconds",)

    def __init__(self) -> None:
        self._seconds: dict[str, list[int]] = {}
        """model -> [the whole second of its last read, reads in that second]"""

    def take(self, model: str, per_s: int, now: float) -> bool:
        """True (and one read fewer left) while ``model`` has had fewer than ``per_s`` floor
        reads in the second ``now`` falls in."""
        if per_s <= 0:
            return False
        second = int(now)
        slot = self._seconds.get(model)
        if slot is None:
            slot = self._seconds[model] = [second, 0]
        elif slot[0] != second:
            slot[0], slot[1] = second, 0
        if slot[1] >= per_s:
            return False
        slot[1] += 1
        return True


UsagePlan = Literal["extproc", "envoy", "envoy_injected"]
"""Who reads a response's usage for the rate limiter: extproc (it reads the body), Envoy
(sse_to_metadata on the usage chunk the client asked for), or Envoy on a usage chunk extproc
asked vLLM for, which Envoy's Lua filter then removes from the client's stream (see
:mod:`routing.render.usage`). Where Envoy has no such filters, extproc reads every stream a
limit settles, and removes an injected chunk itself."""


def usage_plan(body: GenerationBody) -> UsagePlan:
    """How this request's usage can be read without extproc reading the body.

    A stream: Envoy reads the usage chunk. The client asked for it: it keeps it. The client did
    not: extproc adds ``stream_options.include_usage`` and Envoy strips the chunk again, so the
    client sees what it asked for (``continuous_usage_stats`` without ``include_usage`` is
    nothing to vLLM, and is dropped). vLLM's per-chunk usage, asked for with both, is left
    to extproc: every chunk would carry a running count.
    Not streamed: extproc (one body message; Envoy's json_to_metadata would hold the whole
    answer and turn one above its buffer limit into a 500).
    """
    if not body.stream:
        return "extproc"
    if not body.include_usage:
        return "envoy_injected"
    options = body.doc.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "extproc"
    return "envoy"
