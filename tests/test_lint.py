"""ruff and mypy --strict are part of the test suite, so CI runs them with everything else."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def test_ruff_is_clean() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_strict_is_clean() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout[-4000:]


CITATION = re.compile(r"README: ([^).\n]+)")
SOURCE_DIRS = ("llm_sidecar", "sidecar_runtime", "extproc", "ratelimit", "routing", "simulator",
               "tests", "bench")


def cited_sections() -> list[tuple[str, str]]:
    """Every README section a comment or docstring cites (``README`` + colon + names), by file."""
    found = []
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "test_lint.py":  # its own pattern is not a citation
                continue
            for match in CITATION.finditer(path.read_text()):
                found += [(str(path.relative_to(ROOT)), name.strip())
                          for name in match.group(1).split(";")]
    return found


def test_code_cites_only_documents_in_the_repo() -> None:
    """Comments cite README sections by name, and only ones that exist; the public contract lives
    outside the repository, so no comment points into it (``CONTRACT §N``)."""
    headings = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("#")}
    cited = cited_sections()
    assert len(cited) > 20  # the pattern still finds the citations
    missing = [(path, name) for path, name in cited if name not in headings]
    assert missing == []
    outside = [str(path.relative_to(ROOT)) for folder in SOURCE_DIRS
               for path in (ROOT / folder).rglob("*.py")
               if "CONTRACT §" in path.read_text() and path.name != "test_lint.py"]
    assert outside == []
