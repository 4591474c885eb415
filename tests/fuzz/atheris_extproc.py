"""Coverage-guided fuzzing of extproc's request logic with atheris (libFuzzer for Python).

``python -m tests.fuzz.atheris_extproc -atheris_runs=200000`` runs it by hand; the test suite
runs a short, bounded session (``test_atheris.py``). The input bytes become the path choice,
a few headers and the request body; every answer must pass :func:`tests.fuzz.driver.check`.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["extproc"]):
    from extproc import bodies, stream  # noqa: F401
    from extproc.processors import base, embeddings, generation  # noqa: F401

from tests.extproc.helpers import JSON_POST
from tests.fuzz.driver import rich_snapshot, run_stream

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")
SNAPSHOT = rich_snapshot()


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    path = PATHS[fdp.ConsumeIntInRange(0, len(PATHS) - 1)]
    headers = {":path": path, **JSON_POST,
               "authorization": "Bearer " + fdp.ConsumeUnicodeNoSurrogates(12),
               "x-context-length": fdp.ConsumeUnicodeNoSurrogates(6),
               "x-tenant-id": fdp.ConsumeUnicodeNoSurrogates(8)}
    hit = fdp.ConsumeBool()
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    run_stream(headers, body, response_chunks=[body[:64]], found=(b"\x00" * 8,) if hit else None,
               snap=SNAPSHOT)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
