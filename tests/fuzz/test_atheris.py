"""A short, bounded atheris session over extproc's request logic (coverage-guided, unlike the
hypothesis tests); the full-size run is ``python -m tests.fuzz.atheris_extproc``.

atheris is an optional test dependency (installed where a wheel exists: Linux x86-64, Python
3.11); elsewhere this test is skipped and the hypothesis tests still run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 10_000
SEEDS = {
    "chat": b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}], '
            b'"max_tokens": 5, "stream": true}',
    "completion": b'{"model": "llama-2-13b", "prompt": [1, 2, 3], "max_tokens": 1}',
    "embeddings": b'{"model": "bge-m3", "input": ["a", "b", "a"], "dimensions": 8}',
}


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_atheris_session(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, body in SEEDS.items():
        (corpus / name).write_bytes(bytes([0, 1]) + body)
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_extproc", f"-atheris_runs={RUNS}",
         "-max_len=8192", "-rss_limit_mb=2048",
         # libFuzzer re-arms SIGALRM every timeout/2 + 1 s; a short timeout let that alarm
         # kill the process during its teardown after "Done". 120 s still flags a hung input.
         "-timeout=120", str(corpus)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    tail = result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert f"Done {RUNS}" in result.stderr, tail
