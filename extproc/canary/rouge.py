"""ROUGE-L F1 of two answers, by Google's ``rouge-score`` package (docs: Canary verdict).

Its default tokenizer (lower case, letters and digits) and no stemming: the canary's answer is
compared with stable's as written. Its LCS is pure Python and quadratic in the words (about
11 ms for two answers of 256 words, 95 ms at the length cap of
:data:`extproc.canary.text.MAX_CHARS`): in a thread of extproc it would hold the GIL and delay
every request on the event loop, so :class:`RougeProcess` runs it in a child process of its own
(``python -m extproc.canary.rouge``), one line of JSON in and one score out.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from typing import Protocol

import orjson

CALL_TIMEOUT_S = 10.0
"""The longest one comparison may take before the child is replaced (and the pair dropped)."""


class _Scorer(Protocol):
    def score(self, target: str, prediction: str) -> dict[str, object]: ...


@functools.cache
def _scorer() -> _Scorer:
    from rouge_score import rouge_scorer

    scorer: _Scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return scorer


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 of ``candidate`` against ``reference``, 0 to 1 (0 when either has no word)."""
    score = _scorer().score(reference, candidate)["rougeL"]
    return float(score.fmeasure)  # type: ignore[attr-defined]


class RougeProcess:
    """:func:`rouge_l` in a child process, started on first use, one comparison at a time; a
    child that dies or takes longer than :data:`CALL_TIMEOUT_S` is replaced at the next call."""

    def __init__(self) -> None:
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def score(self, reference: str, candidate: str) -> float:
        async with self._lock:
            child = await self._started()
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(orjson.dumps([reference, candidate]) + b"\n")
                await child.stdin.drain()
                line = await asyncio.wait_for(child.stdout.readline(), CALL_TIMEOUT_S)
                return float(line)
            except (OSError, ValueError, TimeoutError):
                await self._stop()
                raise

    async def _started(self) -> asyncio.subprocess.Process:
        child = self._child
        if child is None or child.returncode is not None:
            child = self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "extproc.canary.rouge",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return child

    async def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()

    async def aclose(self) -> None:
        """Close the child's input (it exits at its end), and wait for it."""
        child, self._child = self._child, None
        if child is None or child.returncode is not None:
            return
        if child.stdin is not None:
            child.stdin.close()
        try:
            await asyncio.wait_for(child.wait(), 5.0)
        except TimeoutError:
            child.kill()
            await child.wait()


def serve() -> None:
    """The child: one ``[reference, candidate]`` JSON line in, one score line out, until its
    input ends (its parent closed it, or died)."""
    for line in sys.stdin.buffer:
        reference, candidate = orjson.loads(line)
        sys.stdout.write(f"{rouge_l(str(reference), str(candidate))!r}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
