"""Shared pieces of the chaos suite: the config every scenario runs, probes that tell whether
rate limiting and the embedding cache are really working, metric scraping, and the summary
each scenario prints (fault, what clients saw, recovery time)."""

from __future__ import annotations

import hashlib
import itertools
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos.load import Call, Record, percentile
from tests.harness.gateway import Gateway, default_doc

LOAD_KEY = "sk-chaos-load-0123456789"
"""A listed key with a limit nobody reaches: the background load is never rate limited."""
DEADLINE_S = 0.2
"""``LLM_SIDECAR_REDIS_TIMEOUT_MS`` of the chaos gateways. Not the 50 ms default: on a busy
2-core CI machine a healthy Redis answer sometimes misses 50 ms, which under ``deny`` is a 503
before any fault was injected; the bound being tested is the configured deadline either way."""
RECOVERY_BOUND_S = 3.0
"""The recovery the chaos tests assert once Redis is back. The services guarantee less: they
try Redis again one breaker cooldown (1 s) after it failed, and a down Cluster master every
0.1 s; docs/operations/reliability.md gives the spread. The rest is margin for a 2-core machine running
other suites, where a probe now and then misses its 200 ms deadline and waits another cooldown.
Every test prints what it measured: a bound close to the measured figure failed landings at
random."""
HUNG_S = 5.0
"""A request that took longer was stuck, not slow: every wait in its path is bounded far below
it (the Redis deadline 0.2 s, Envoy's rate-limit timeout 0.25 s), while a healthy request's
p99 has reached 1.6 s on this machine under other suites' load."""


def chaos_doc(policy: str = "allow") -> dict[str, Any]:
    """Every pool simulated; probe keys get 1 request per hour, the load key is unlimited in
    practice; bge-m3 embeddings are cached."""
    doc = default_doc()
    doc["api_keys"] = [{"name": "load-bot", "tenant": "load",
                        "sha256": hashlib.sha256(LOAD_KEY.encode()).hexdigest()}]
    doc["rate_limits"] = {
        "api_key": {"default": {"requests": "1/h"},
                    "overrides": {"load-bot": {"requests": "100000/s"}}},
        "on_backend_error": policy,
    }
    doc["models"]["bge-m3"]["cache"] = {"namespace": "bge-m3", "ttl": "1h"}
    return doc


def chat_call(key: str = LOAD_KEY, stream: bool = False, n: int = 0) -> Call:
    body = {"model": "llama-2-13b", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": f"chaos {n}"}]}
    return Call("stream" if stream else "chat", "/v1/chat/completions",
                json.dumps(body).encode(), {"authorization": f"Bearer {key}"})


def embed_call(text: str, key: str = LOAD_KEY) -> Call:
    body = {"model": "bge-m3", "input": text}
    return Call("embed", "/v1/embeddings", json.dumps(body).encode(),
                {"authorization": f"Bearer {key}"})


def mixed(n: int) -> Call:
    """The background mix: plain chat, SSE streams, embeddings of 8 recurring inputs (so the
    cache has hits while Redis is up)."""
    kind = n % 4
    if kind == 0:
        return chat_call(n=n)
    if kind == 1:
        return chat_call(stream=True, n=n)
    return embed_call(f"recurring input {n % 8}")


def post(url: str, call: Call, timeout_s: float = 10.0) -> Record:
    """One request, synchronously (the probes)."""
    request = urllib.request.Request(f"{url}{call.path}", data=call.body, method="POST",
                                     headers={"content-type": "application/json", **call.headers})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
            status, headers, code = resp.status, resp.headers, None
    except urllib.error.HTTPError as err:
        body = err.read()
        status, headers = err.code, err.headers
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "not_json"
    except OSError as exc:
        return Record(call.kind, started, time.monotonic() - started, 0, type(exc).__name__)
    kept = {k.lower(): v for k, v in headers.items() if k.lower().startswith(("x-llm-", "x-ratelimit"))}
    return Record(call.kind, started, time.monotonic() - started, status, code, kept)


_probe_ids = itertools.count()


def rate_limit_probe(url: str) -> str:
    """Two requests with a fresh key whose limit is 1 per hour: ``enforced`` (200 then 429
    rate_limit_exceeded: Redis decided), ``allowed`` (both 200: on_backend_error allow),
    ``denied`` (both refused with 503 upstream_unavailable: on_backend_error deny), else a
    description of what came back."""
    key = f"sk-probe-{uuid.uuid4().hex}-{next(_probe_ids)}"
    first, second = post(url, chat_call(key)), post(url, chat_call(key))
    pair = ((first.status, first.code), (second.status, second.code))
    if pair == ((200, None), (429, "rate_limit_exceeded")):
        return "enforced"
    if pair == ((200, None), (200, None)):
        return "allowed"
    if pair == ((503, "upstream_unavailable"), (503, "upstream_unavailable")):
        return "denied"
    return f"unexpected {pair}"


def cache_probe(url: str) -> str:
    """``x-llm-cache`` of an embedding of a fixed input (hit, miss or bypass), or the error."""
    record = post(url, embed_call("the cache probe input"))
    if record.status != 200:
        return f"status {record.status} {record.code}"
    return record.headers.get("x-llm-cache", "none")


def wait_until(check: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until ``check()`` was first true; raises AssertionError after ``timeout_s``."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s")
        time.sleep(step_s)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in scrape(url).items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


def cache_lookups(extproc_metrics: str, *results: str) -> float:
    """extproc's embedding-cache lookups so far with one of ``results`` (hit, miss, partial,
    bypass)."""
    return sum(metric(extproc_metrics, "llm_sidecar_cache_lookups_total", result=result)
               for result in results)


def set_policy(gw: Gateway, doc: dict[str, Any], policy: str) -> None:
    """Rewrite ``on_backend_error`` in the running gateway's YAML; wait until ratelimit
    reloaded it."""
    if doc["rate_limits"]["on_backend_error"] == policy:
        return
    before = metric(gw.ratelimit_metrics, "ratelimit_config_reloads_total", result="ok")
    doc["rate_limits"]["on_backend_error"] = policy
    with open(gw.config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle, sort_keys=False)
    wait_until(lambda: metric(gw.ratelimit_metrics, "ratelimit_config_reloads_total",
                              result="ok") > before, 10, 0.1)


def summary(name: str, base: list[Record], outage: list[Record], after: list[Record],
            recovery: dict[str, float]) -> str:
    def p99(records: list[Record]) -> float:
        return percentile([r.latency for r in records], 99) * 1000

    def statuses(records: list[Record]) -> str:
        counts: dict[str, int] = {}
        for r in records:
            label = f"{r.status}" + (f" {r.code}" if r.code else "")
            counts[label] = counts.get(label, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))

    rec = ", ".join(f"{k} {v:.2f} s" for k, v in recovery.items())
    worst = max((r.latency for r in outage), default=0.0) * 1000
    return (f"[chaos] {name}: baseline p99 {p99(base):.0f} ms ({len(base)} req); "
            f"outage p99 {p99(outage):.0f} ms, max {worst:.0f} ms "
            f"({statuses(outage)}); after p99 {p99(after):.0f} ms; recovery: {rec}")
