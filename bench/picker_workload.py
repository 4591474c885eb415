"""The workload and the report of ``python -m bench.picker_load``: pure, no processes, no clock.

Each client has its own script, an endless iterator of requests drawn from ``Random(seed, client)``,
so both modes of a run (and every run with the same seed) send each client the same requests in
the same order; only how far a client gets in the time allowed differs. A script mixes:

* **conversations** (``chat``): one of ``groups`` shared system prompts (~``system_tokens``) and
  2 to 5 turns, each turn's prompt the previous one plus a canned assistant reply and a new user
  message, so a conversation's next turn starts with its previous prompt (what a pod's prefix
  cache keeps) and every conversation of a group starts with the group's system prompt;
* **long low-priority asks** (``long``, ``long_share`` of the requests): a document of its own
  (~``long_tokens``) to summarise with a large output budget, which holds a lot of KV cache for a
  long time and, by the priority weight (prompt x output / 1000), is ``low``.

Tokens are counted as the simulator and extproc's estimate count them: 4 bytes of text each.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "long"]
BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class Workload:
    """What the clients send (the defaults are the bench's workload, chosen before any run)."""

    seed: int = 15
    groups: int = 8
    system_tokens: int = 1000
    turns: tuple[int, int] = (2, 5)
    user_tokens: tuple[int, int] = (60, 180)
    reply_tokens: tuple[int, int] = (40, 120)
    chat_max_tokens: tuple[int, int] = (32, 96)
    long_share: float = 0.15
    long_tokens: tuple[int, int] = (2500, 3200)
    long_max_tokens: int = 256


@dataclass(frozen=True)
class Request:
    kind: Kind
    group: int
    """The conversation group (-1 for a long ask)."""
    messages: tuple[tuple[str, str], ...]
    max_tokens: int

    def body(self, model: str) -> dict[str, Any]:
        return {"model": model, "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": role, "content": text} for role, text in self.messages]}

    @property
    def prompt_tokens(self) -> int:
        return sum(len(text) for _, text in self.messages) // BYTES_PER_TOKEN


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(size)]


def _text(rng: random.Random, words: Sequence[str], tokens: int) -> str:
    out: list[str] = []
    length = 0
    while length < tokens * BYTES_PER_TOKEN:
        word = rng.choice(words)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Corpus:
    """What every client shares: the vocabulary and each group's system prompt."""

    words: list[str] = field(repr=False)
    systems: list[str] = field(repr=False)

    @classmethod
    def of(cls, workload: Workload) -> Corpus:
        rng = random.Random(workload.seed)
        words = _vocabulary(rng)
        systems = [f"You are assistant #{g} of the bench. " + _text(rng, words, workload.system_tokens)
                   for g in range(workload.groups)]
        return cls(words, systems)


def script(workload: Workload, corpus: Corpus, client: int) -> Iterator[Request]:
    """Client ``client``'s requests, in order, forever (the same for the same seed and client)."""
    rng = random.Random(f"{workload.seed}/{client}")
    w = workload
    # A draw is one long ask or a whole conversation (turns requests): the draw probability that
    # makes long asks ``long_share`` of the requests.
    turns = sum(w.turns) / 2
    p_long = w.long_share * turns / (1 - w.long_share + w.long_share * turns)
    while True:
        if rng.random() < p_long:
            doc = _text(rng, corpus.words, rng.randint(*w.long_tokens))
            yield Request("long", -1, (("user", "Summarise this document in detail.\n" + doc),),
                          w.long_max_tokens)
            continue
        group = rng.randrange(w.groups)
        messages: list[tuple[str, str]] = [("system", corpus.systems[group])]
        for _ in range(rng.randint(*w.turns)):
            messages.append(("user", _text(rng, corpus.words, rng.randint(*w.user_tokens))))
            yield Request("chat", group, tuple(messages), rng.randint(*w.chat_max_tokens))
            messages.append(("assistant", _text(rng, corpus.words, rng.randint(*w.reply_tokens))))


@dataclass(frozen=True)
class Result:
    """One request as the client saw it (times in seconds from the start of the mode's window)."""

    kind: Kind
    status: int
    """200, or the last failed status (599: connection error or a cut stream)."""
    started: float
    ended: float
    ttft: float | None
    """Request sent to first generated token (the role chunk does not count)."""
    output_tokens: int
    pod: str | None
    """The simulator that answered (its ``x-sim-name``)."""
    shed: int = 0
    """503 ``server_overloaded`` answers it got (and waited ``retry-after`` on) first."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class PodDelta:
    """What one pod's ``/metrics`` counters moved by during the window."""

    name: str
    speed: float
    requests: float
    prefix_queries: float
    prefix_hits: float
    load: tuple[tuple[int, int, float], ...] = ()
    """(running, waiting, KV use) sampled from the pod's ``/sim/state`` during the window."""

    def mean(self, i: int) -> float:
        return sum(s[i] for s in self.load) / len(self.load) if self.load else math.nan


@dataclass(frozen=True)
class ModeReport:
    mode: str
    window_s: float
    results: list[Result]
    pods: list[PodDelta]
    extproc_cpu_s: float
    attempts: int
    """HTTP requests sent (retries after a shed included): what extproc processed."""
    load: list[float]
    """1-minute load averages sampled during the mode."""
    extproc_idle_cpu: float = math.nan
    """extproc's CPU seconds per second before any request (the picker's scraping)."""


def _ok(results: Sequence[Result], kind: Kind | None = None) -> list[Result]:
    return [r for r in results if r.status == 200 and (kind is None or r.kind == kind)]


def rows(report: ModeReport) -> list[tuple[str, float, str]]:
    """(metric, value, format) of one mode, in table order; NaN where nothing was measured."""
    res, window = report.results, report.window_s
    ok = _ok(res)
    in_window = [r for r in ok if r.ended <= window]
    ms = 1000.0
    out: list[tuple[str, float, str]] = [
        ("completed requests (in window)", len(in_window), "{:.0f}"),
        ("failed requests", sum(1 for r in res if r.status != 200), "{:.0f}"),
        ("503 sheds (client waited, retried)", sum(r.shed for r in res), "{:.0f}"),
        ("throughput, req/s", len(in_window) / window, "{:.2f}"),
        ("output tokens/s", sum(r.output_tokens for r in in_window) / window, "{:.0f}"),
    ]
    kinds: tuple[tuple[str, Kind | None], ...] = (("all", None), ("chat", "chat"), ("long", "long"))
    for label, kind in kinds:
        sel = _ok(res, kind)
        ttft = [r.ttft * ms for r in sel if r.ttft is not None]
        e2e = [(r.ended - r.started) * ms for r in sel]
        out += [(f"TTFT P50 ms ({label})", percentile(ttft, 50), "{:.0f}"),
                (f"TTFT P99 ms ({label})", percentile(ttft, 99), "{:.0f}"),
                (f"end-to-end P50 ms ({label})", percentile(e2e, 50), "{:.0f}"),
                (f"end-to-end P99 ms ({label})", percentile(e2e, 99), "{:.0f}")]
    queries = sum(p.prefix_queries for p in report.pods)
    hits = sum(p.prefix_hits for p in report.pods)
    out.append(("prefix-cache hit rate (tokens)", hits / queries if queries else math.nan, "{:.1%}"))
    served = sum(p.requests for p in report.pods)
    for pod in report.pods:
        out.append((f"share of requests, {pod.name} (speed {pod.speed:g})",
                    pod.requests / served if served else math.nan, "{:.1%}"))
    out.append(("extproc CPU ms / request", report.extproc_cpu_s * ms / report.attempts
                if report.attempts else math.nan, "{:.2f}"))
    out.append(("extproc CPU with no traffic, ms/s", report.extproc_idle_cpu * ms, "{:.1f}"))
    out.append(("load average (1 min), mean in run", sum(report.load) / len(report.load)
                if report.load else math.nan, "{:.2f}"))
    return out


def _fmt(value: float, fmt: str) -> str:
    return "n/a" if math.isnan(value) else fmt.format(value)


def table(baseline: ModeReport, candidate: ModeReport) -> str:
    """The Markdown table: one row per metric, the two modes and candidate / baseline."""
    head = (f"| metric | {baseline.mode} | {candidate.mode} | {candidate.mode} / {baseline.mode} |\n"
            "|---|---|---|---|\n")
    lines = []
    for (name, base, fmt), (_, cand, _) in zip(rows(baseline), rows(candidate), strict=True):
        ratio = cand / base if base and not (math.isnan(base) or math.isnan(cand)) else math.nan
        shown = "" if name.startswith("load average") else _fmt(ratio, "{:.2f}x")
        lines.append(f"| {name} | {_fmt(base, fmt)} | {_fmt(cand, fmt)} | {shown} |")
    return head + "\n".join(lines) + "\n"


def pod_table(report: ModeReport) -> str:
    """Where the requests went and what each pod went through: evidence for the reading."""
    lines = [f"| {report.mode}: pod | speed | share | mean running | mean waiting | mean KV use | "
             "prefix hits | long asks | chat TTFT P50 ms | chat TTFT P99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    served = sum(p.requests for p in report.pods)
    for pod in report.pods:
        ttft = [r.ttft * 1000 for r in _ok(report.results, "chat")
                if r.pod == pod.name and r.ttft is not None]
        share = pod.requests / served if served else math.nan
        hits = pod.prefix_hits / pod.prefix_queries if pod.prefix_queries else math.nan
        longs = sum(1 for r in _ok(report.results, "long") if r.pod == pod.name)
        lines.append(f"| {pod.name} | {pod.speed:g} | {_fmt(share, '{:.1%}')} | "
                     f"{_fmt(pod.mean(0), '{:.1f}')} | {_fmt(pod.mean(1), '{:.1f}')} | "
                     f"{_fmt(pod.mean(2), '{:.0%}')} | {_fmt(hits, '{:.1%}')} | {longs} | "
                     f"{_fmt(percentile(ttft, 50), '{:.0f}')} | {_fmt(percentile(ttft, 99), '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def parse_counter(text: str, name: str, skip: str | None = None) -> float:
    """The sum of every sample of ``name`` (any labels; not those whose line holds ``skip``) in a
    Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")
                and (skip is None or skip not in line)):
            total += float(line.rsplit(" ", 1)[1])
    return total
