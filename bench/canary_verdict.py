"""``python -m bench.canary_verdict``: extproc's extra CPU for the canary verdict, in one
process, no Envoy (docs: Canary verdict).

    .venv/bin/python -m bench.canary_verdict [--repeats 5] [--shadows 200] [--batch 50]
        [--no-e2e]

What it measures, each the median of ``--repeats`` rounds (min and max beside it):

1. **Per comparison**: ``rouge_l(stable, canary)`` on a typical chat answer (~100 words) and on
   the bound (both texts :data:`extproc.canary.text.MAX_CHARS` characters of words), with the
   two texts identical and with about half the canary's words changed.
2. **Per verdict**: ``judge(PairMetrics.stats(model), spec)`` with 30, 1,000 and 10,000 pairs
   recorded (reading the metric families back, then the bootstrap); the shadow runner judges
   once per compared pair.
3. **Per shadowed request, stable side**: a 256-token chat stream as vLLM sends it (one
   ``data:`` event per token, a usage chunk, ``[DONE]``) fed event by event through
   :class:`AnswerText`, plus :func:`shadow_body` for the replayed request.
4. **Per shadow, end to end**: one simulated pod (``llm-sidecar sim``, no decode delay) as the
   canary pool, a :class:`ShadowRunner` on this process's event loop, ``--shadows`` 256-token
   chat shadows submitted ``--batch`` at a time (each batch awaited): ``time.process_time``
   of this process plus the CPU of the runner's ROUGE-L child process (``/proc``) per shadow,
   and the shares of it that ROUGE-L (the child) and the verdict (measured around the calls)
   take. The pod
   answers one word per token (256 words); stable's side of each pair is the pod's own answer
   with about half its words changed.

Parts 1 to 3 are the calling thread's CPU (``time.thread_time``). The pod runs in its own
process and is not counted; on a shared machine the minimum is the better guide.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, ParamSpec, TypeVar
from unittest.mock import patch

import orjson
from prometheus_client import CollectorRegistry

from bench.acct import cpu_seconds
from extproc.actions import ShadowJob
from extproc.canary.guard import CanaryGuards
from extproc.canary.rouge import rouge_l
from extproc.canary.shadow import ShadowRunner
from extproc.canary.text import MAX_CHARS, AnswerText
from extproc.canary.verdict import Pair, PairMetrics, judge
from extproc.processors.generation import shadow_body
from routing.compiled import Snapshot, compile_config
from routing.loader import validate
from routing.schema import CompareSpec
from routing.yamlsrc import Located
from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_http_ok

MODEL = "chat-model"
CANARY = "chat-model-canary"
TOKENS = 256
_VOCABULARY = (
    "the of and to in is that it for you was with on as have be at this are from by not but "
    "what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life "
    "enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study second "
    "eyes soon times story boys since white days ever paper hard near sentence better best "
    "across during today others however sure means knew try told young miles sun ways thing "
    "whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually money seen car morning given"
)
_WORDS = tuple(_VOCABULARY.split())

_P = ParamSpec("_P")
_R = TypeVar("_R")


def words(rng: random.Random, count: int) -> list[str]:
    return [rng.choice(_WORDS) for _ in range(count)]


def bounded_text(rng: random.Random, chars: int) -> str:
    """Words, with punctuation now and then, up to ``chars`` characters."""
    out: list[str] = []
    size = 0
    while True:
        word = rng.choice(_WORDS) + ("." if rng.random() < 0.08 else "")
        if size + len(word) + (1 if out else 0) > chars:
            return " ".join(out)
        size += len(word) + (1 if out else 0)
        out.append(word)


def changed(rng: random.Random, text: str, share: float) -> str:
    """``text`` with each word replaced by another with probability ``share``."""
    return " ".join(rng.choice(_WORDS) if rng.random() < share else w for w in text.split())


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):10.1f} {min(values):10.1f} {max(values):10.1f}"


def cpu_per_call(call: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """Microseconds of this thread's CPU per ``call()``, one figure per round."""
    call()  # warm: imports, the scorer built on first use, caches
    out = []
    for _ in range(repeats):
        start_s = time.thread_time()
        for _ in range(calls):
            call()
        out.append((time.thread_time() - start_s) / calls * 1e6)
    return out


# --- 1. per comparison -------------------------------------------------------------------------

def comparisons(repeats: int) -> list[tuple[str, list[float], float]]:
    rng = random.Random(41)
    typical = " ".join(words(rng, 100))
    bounded = bounded_text(rng, MAX_CHARS)
    rows = []
    for name, text, calls in (("~100 words", typical, 200), (f"{MAX_CHARS} chars", bounded, 3)):
        for kind, other in (("identical", text), ("~50% changed", changed(rng, text, 0.5))):
            label = f"rouge_l, {name} ({len(text.split())} words), {kind}"
            rows.append((label, cpu_per_call(partial(rouge_l, text, other), calls, repeats),
                         rouge_l(text, other)))
    return rows


# --- 2. per verdict ----------------------------------------------------------------------------

def spec() -> CompareSpec:
    return CompareSpec(shadow_percent=100, max_shadows_per_s=10_000, max_in_flight=64)


def recorded(pairs: int) -> PairMetrics:
    rng = random.Random(pairs)
    metrics = PairMetrics(CollectorRegistry())
    for _ in range(pairs):
        metrics.add(Pair(MODEL, min(1.0, max(0.0, rng.gauss(0.7, 0.15))),
                         (rng.uniform(0.05, 0.5), rng.uniform(0.05, 0.6)),
                         (rng.uniform(0.01, 0.03), rng.uniform(0.01, 0.04)),
                         (rng.uniform(50, 300), rng.uniform(50, 320))))
    return metrics


def _verdict(metrics: PairMetrics, compare: CompareSpec) -> object:
    return judge(metrics.stats(MODEL), compare)


def verdicts(repeats: int) -> list[tuple[str, list[float]]]:
    rows = []
    compare = spec()
    for pairs in (30, 1_000, 10_000):
        metrics = recorded(pairs)
        rows.append((f"stats() only, {pairs:,} pairs",
                     cpu_per_call(partial(metrics.stats, MODEL), 50, repeats)))
        rows.append((f"judge(stats()), {pairs:,} pairs",
                     cpu_per_call(partial(_verdict, metrics, compare), 50, repeats)))
    return rows


# --- 3. per shadowed request, stable side ------------------------------------------------------

def chat_request(rng: random.Random) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": TOKENS, "temperature": 0.7,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": " ".join(words(rng, 60)) + "?"}]}


def vllm_stream(rng: random.Random, tokens: int) -> list[bytes]:
    """A chat stream as vLLM sends it: one event per token, then the usage chunk and
    ``[DONE]`` (what Envoy hands extproc, one event per body chunk)."""
    head = {"id": "chatcmpl-5f0c0d3b9e8e4a0f9f6b1d2c3a4b5c6d", "object": "chat.completion.chunk",
            "created": 1765084800, "model": MODEL}
    events = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}]
    for k in range(tokens):
        last = k == tokens - 1
        events.append({**head, "choices": [{"index": 0,
                                            "delta": {"content": " " + rng.choice(_WORDS)},
                                            "logprobs": None,
                                            "finish_reason": "length" if last else None}]})
    events.append({**head, "choices": [], "usage": {"prompt_tokens": 80, "total_tokens":
                                                    80 + tokens, "completion_tokens": tokens}})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def stable_side(repeats: int) -> list[tuple[str, list[float]]]:
    rng = random.Random(43)
    chunks = vllm_stream(rng, TOKENS)
    doc = chat_request(rng)

    def read() -> str:
        answer = AnswerText(streamed=True)
        for chunk in chunks:
            answer.feed(chunk)
        answer.finish()
        assert answer.done and not answer.broken and answer.completion_tokens == TOKENS
        return answer.text

    def both() -> None:
        read()
        shadow_body(doc, CANARY)

    return [(f"AnswerText, {TOKENS}-token chat stream, {len(chunks)} chunks",
             cpu_per_call(read, 200, repeats)),
            ("shadow_body (chat request)", cpu_per_call(lambda: shadow_body(doc, CANARY),
                                                        2000, repeats)),
            ("stable side per shadowed request (both)", cpu_per_call(both, 200, repeats))]


# --- 4. per shadow, end to end -----------------------------------------------------------------

@contextmanager
def canary_pod(workdir: str) -> Iterator[str]:
    port = free_port()
    child: Child = start("sim canary", sidecar_command(
        "sim", "--host", "127.0.0.1", "--port", str(port), "--name", "canary",
        "--max-model-len", "8192", "--decode-ms-per-token", "0",
        "--prefill-ms-per-token", "0", "--no-dcgm"),
        log_path=os.path.join(workdir, "sim-canary.log"))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, child)
        yield f"127.0.0.1:{port}"
    finally:
        child.stop()


def canary_snapshot(endpoint: str) -> Snapshot:
    doc = {
        "version": 1,
        "clusters": {"stable": {"endpoints": ["127.0.0.1:9"], "max_context": 8192},
                     "canary": {"endpoints": [endpoint], "max_context": 8192}},
        "models": {MODEL: {"clusters": ["stable"], "canary": {
            "model": CANARY, "cluster": "canary", "percent": 0,
            "compare": {"shadow_percent": 100, "max_shadows_per_s": 10_000,
                        "max_in_flight": 64}}}},
    }
    return compile_config(validate(Located("bench.yaml", doc, {})))


class ThreadCpu:
    """Wraps a function to add up the CPU of the threads that call it (thread-safe enough:
    one float add per call, under the GIL)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            start_s = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start_s
                self.calls += 1
        return timed


async def _shadows(snapshot: Snapshot, jobs: list[ShadowJob], warm: int, shadows: int,
                   batch: int, repeats: int, metrics: PairMetrics
                   ) -> tuple[list[float], list[float], list[float], list[float]]:
    verdict = ThreadCpu()
    runner = ShadowRunner(lambda: snapshot, CanaryGuards(), metrics)
    me = asyncio.current_task()

    async def run(count: int) -> None:
        for first in range(0, count, batch):
            for k in range(first, min(count, first + batch)):
                runner.submit(jobs[k % len(jobs)])
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not me))

    per, rouge_share, judge_share, rouge_us = [], [], [], []
    # The runner's module-level judge, so the calls it makes are the ones timed; ROUGE-L runs
    # in the runner's child process, whose CPU is read from /proc.
    with patch("extproc.canary.shadow.judge", verdict.wrap(judge)):
        try:
            await run(warm)
            child = runner._rouge._child
            assert child is not None
            for _ in range(repeats):
                verdict.seconds = 0.0
                start_s, child_s = time.process_time(), cpu_seconds(child.pid)
                await run(shadows)
                spent = time.process_time() - start_s
                rouge_s = cpu_seconds(child.pid) - child_s
                per.append((spent + rouge_s) / shadows * 1e6)
                rouge_share.append(100 * rouge_s / (spent + rouge_s))
                judge_share.append(100 * verdict.seconds / (spent + rouge_s))
                rouge_us.append(rouge_s / shadows * 1e6)
        finally:
            await runner.aclose()
    return per, rouge_share, judge_share, rouge_us


def end_to_end(shadows: int, batch: int, repeats: int) -> tuple[list[tuple[str, list[float]]],
                                                                  str]:
    rng = random.Random(47)
    with tempfile.TemporaryDirectory(prefix="bench-canary-") as workdir, \
            canary_pod(workdir) as endpoint:
        snapshot = canary_snapshot(endpoint)
        canary = snapshot.models[MODEL].canary
        assert canary is not None
        jobs = []
        for _ in range(8):
            doc = chat_request(rng)
            body = shadow_body(doc, CANARY)
            # The pod's own answer, half its words changed: stable's side of the pair.
            plain = orjson.dumps({**doc, "model": CANARY})
            request = urllib.request.Request(f"http://{endpoint}/v1/chat/completions", plain,
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                answer = orjson.loads(resp.read())["choices"][0]["message"]["content"]
            jobs.append(ShadowJob(MODEL, canary, "/v1/chat/completions", body,
                                  doc["messages"][-1]["content"].encode(),
                                  changed(rng, answer, 0.5), 0.12, 0.02, float(TOKENS)))
        metrics = PairMetrics(CollectorRegistry())
        per, rouge_share, judge_share, rouge_us = asyncio.run(
            _shadows(snapshot, jobs, batch, shadows, batch, repeats, metrics))
    counts = {s.labels["result"]: int(s.value) for family in metrics.shadows.collect()
              for s in family.samples if s.name.endswith("_total")}
    note = (f"shadows by result: {counts}; pairs judged {metrics.stats(MODEL).pairs}, "
            f"mean ROUGE-L {metrics.stats(MODEL).rouge_sum / max(1, metrics.stats(MODEL).pairs):.3f}")
    return [(f"per shadow ({TOKENS} tokens, {shadows} shadows, {batch} at a time), process CPU",
             per),
            ("  of which ROUGE-L (child process), us", rouge_us),
            ("  ROUGE-L share, %", rouge_share),
            ("  verdict (judge per pair) share, %", judge_share)], note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_verdict",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shadows", type=int, default=200, help="shadows per round (part 4)")
    parser.add_argument("--batch", type=int, default=50, help="shadows submitted at once (<= 64)")
    parser.add_argument("--no-e2e", action="store_true", help="skip part 4 (no simulator)")
    args = parser.parse_args(argv)
    print("command: " + shlex.join([os.path.basename(sys.executable), "-m",
                                    "bench.canary_verdict", *sys.argv[1:]]))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.repeats} repeats; "
          "figures in us of CPU (median, min, max) unless marked %")
    print(f"\n{'1. per comparison':70s} {'median':>10s} {'min':>10s} {'max':>10s}")
    for label, values, score in comparisons(args.repeats):
        print(f"{label + f' [F1 {score:.2f}]':70s} {_summary(values)}")
    print("\n2. per verdict")
    for label, values in verdicts(args.repeats):
        print(f"{label:70s} {_summary(values)}")
    print("\n3. per shadowed request, stable side")
    for label, values in stable_side(args.repeats):
        print(f"{label:70s} {_summary(values)}")
    if not args.no_e2e:
        print("\n4. per shadow, end to end (ShadowRunner -> simulated pod)")
        rows, note = end_to_end(args.shadows, args.batch, args.repeats)
        for label, values in rows:
            print(f"{label:70s} {_summary(values)}")
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
