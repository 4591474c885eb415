"""What the benchmark runs: gateway stacks x workloads, and which row each is compared with.

A *stack* is what stands between the load generator and the stand-in upstream; a *workload* is
one kind of request. A *scenario* (one row of the report) is a workload through a stack, with
the row whose latency it is compared with (its baseline) from the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bench import bodies
from bench.front import BENCH_CLUSTER_HEADER, Variant

StackName = Literal["direct", "bare", "headers", "body", "full-memory", "full-redis", "litellm"]
PROMPT_220KB = 220 * 1024


@dataclass(frozen=True)
class StackSpec:
    name: StackName
    title: str
    variant: Variant | None
    """Front Envoy variant; None: no front Envoy (the upstream itself, or LiteLLM)."""
    store: Literal["memory", "redis"] | None = None


STACKS: dict[StackName, StackSpec] = {s.name: s for s in (
    StackSpec("direct", "no gateway (client → stand-in upstream)", None),
    StackSpec("bare", "bare Envoy", "bare"),
    StackSpec("headers", "+ extproc, request headers only", "headers"),
    StackSpec("body", "+ extproc, buffered body (as rendered)", "body"),
    StackSpec("full-memory", "+ extproc + ratelimit (memory)", "full", "memory"),
    StackSpec("full-redis", "+ extproc + ratelimit (Redis)", "full", "redis"),
    StackSpec("litellm", "LiteLLM proxy, Redis rpm/tpm", None, "redis"),
)}


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    path: str
    body: bytes
    cluster: str
    """Pool the bare stack routes to (``x-bench-cluster``); extproc picks its own."""
    rates: tuple[int, ...]
    saturate: bool
    stream: bool = False
    latency_s: float = 0.01
    """Expected time per request, to size the connection pool of a fixed load (and how long
    the load generator waits for the last answers after its sending window)."""
    tokens: int | None = None
    """Tokens streamed one event at a time (paced): the report adds CPU per token."""


def workloads(rates: tuple[int, ...], paced256_rate: int = 12) -> dict[str, Workload]:
    slow = tuple(r for r in rates if r <= 200) or rates[:1]
    return {w.name: w for w in (
        Workload("chat", "chat, 64 tokens out", "/v1/chat/completions", bodies.chat_request(),
                 "pool-short", rates, True),
        Workload("embed", "embeddings, 2 inputs", "/v1/embeddings", bodies.embeddings_request(),
                 "embed", slow + tuple(r for r in rates if r == 500), False),
        Workload("p220", "chat, 220 KB prompt", "/v1/chat/completions",
                 bodies.chat_request(PROMPT_220KB), "pool-long", (20, 100), False),
        Workload("sse", "chat stream, 64 events in one body", "/v1/chat/completions",
                 bodies.chat_request(stream=True), "pool-short",
                 slow + tuple(r for r in rates if r == 500), False, stream=True),
        Workload("paced", "chat stream, 16 tokens 5 ms apart", "/v1/chat/completions",
                 bodies.chat_request(stream=True, model=bodies.PACED_MODEL), "paced",
                 (50, 100), False, stream=True, latency_s=0.15, tokens=16),
        # 12 req/s x ~7.7 s: ~92 streams open, ~3,100 tokens/s, as a few busy vLLM pods send.
        Workload("paced256", "chat stream, 256 tokens 30 ms apart", "/v1/chat/completions",
                 bodies.chat_request(stream=True, model=bodies.PACED256_MODEL, max_tokens=256),
                 "paced256", (paced256_rate,), False, stream=True, latency_s=8.0, tokens=256),
    )}


@dataclass(frozen=True)
class Scenario:
    key: str
    stack: StackName
    workload: str
    baseline: str | None
    """Key of the scenario whose latency this one adds to."""


def scenarios(with_litellm: bool) -> list[Scenario]:
    rows = [
        Scenario("direct/chat", "direct", "chat", None),
        Scenario("bare/chat", "bare", "chat", "direct/chat"),
        Scenario("headers/chat", "headers", "chat", "bare/chat"),
        Scenario("body/chat", "body", "chat", "bare/chat"),
        Scenario("full-memory/chat", "full-memory", "chat", "bare/chat"),
        Scenario("full-redis/chat", "full-redis", "chat", "bare/chat"),
    ]
    for name in ("embed", "p220", "sse", "paced", "paced256"):
        rows += [Scenario(f"bare/{name}", "bare", name, None),
                 Scenario(f"full-redis/{name}", "full-redis", name, f"bare/{name}")]
    if with_litellm:
        rows += [Scenario("litellm/chat", "litellm", "chat", "direct/chat"),
                 # No direct/paced256 row: the paced server is the same behind every stack.
                 Scenario("litellm/paced256", "litellm", "paced256", "bare/paced256")]
    return rows


def request_headers(stack: StackName, workload: Workload, bearer: str) -> tuple[tuple[str, str], ...]:
    headers = [("content-type", "application/json"), ("authorization", f"Bearer {bearer}"),
               (BENCH_CLUSTER_HEADER, workload.cluster)]
    if workload.stream:
        # The stand-in upstream answers SSE on this header (it cannot read the body).
        headers.append(("x-bench-stream", "1"))
    return tuple(headers)
