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


CITATION = re.compile(r"\bdocs: ([A-Z][^).\n]*)")
"""A citation: ``docs`` + colon + a heading of a page under ``docs/`` (or of README.md), several
joined by ``;``. Headings start with a capital letter, which keeps annotations like
``docs: list[...]`` out."""
SOURCE_DIRS = ("llm_sidecar", "sidecar_runtime", "extproc", "ratelimit", "routing", "simulator",
               "tests", "bench")


def cited_sections() -> list[tuple[str, str]]:
    """Every docs heading a comment or docstring cites, by file."""
    found = []
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "test_lint.py":  # its own pattern is not a citation
                continue
            for match in CITATION.finditer(path.read_text()):
                found += [(str(path.relative_to(ROOT)), name.strip())
                          for name in match.group(1).split(";")]
    return found


def doc_headings() -> set[str]:
    """The headings of README.md and every page under docs/ (lines in code fences are not)."""
    headings: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        fenced = False
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif line.startswith("#") and not fenced:
                headings.add(line.lstrip("#").strip())
    return headings


def test_code_cites_only_documents_in_the_repo() -> None:
    """Comments cite documentation by heading (``docs`` + colon + the heading), and only headings
    that exist; the public contract lives outside the repository, so no comment points into it
    (``CONTRACT §N``)."""
    headings = doc_headings()
    cited = cited_sections()
    assert len(cited) > 20  # the pattern still finds the citations
    missing = [(path, name) for path, name in cited if name not in headings]
    assert missing == []
    outside = [str(path.relative_to(ROOT)) for folder in SOURCE_DIRS
               for path in (ROOT / folder).rglob("*.py")
               if "CONTRACT §" in path.read_text() and path.name != "test_lint.py"]
    assert outside == []


def test_a_citation_of_a_missing_heading_is_found() -> None:
    """The check above would fail on a heading no page has."""
    cited = [m.group(1) for m in CITATION.finditer("# x (docs: No such heading here).")]
    assert cited == ["No such heading here"] and cited[0] not in doc_headings()


RUNTIME_PACKAGES = ("llm_sidecar", "extproc", "ratelimit", "routing", "sidecar_runtime",
                    "simulator", "llmmodel")


def _imported_top_levels(package: str) -> set[str]:
    import ast

    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_of_the_services_is_a_declared_dependency() -> None:
    # `pip install -e .` (README's first command) installs only `dependencies`: a module the
    # services import that arrives only with [test] (hpack came with h2) passes every test and
    # fails `llm-sidecar up` in a fresh clone.
    import importlib.metadata
    import tomllib

    declared = {re.split(r"[\[<>=~! ;]", dep, maxsplit=1)[0].lower().replace("_", "-")
                for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                ["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for package in RUNTIME_PACKAGES:
        for name in sorted(_imported_top_levels(package)):
            if name in sys.stdlib_module_names or name in RUNTIME_PACKAGES or name == "__future__":
                continue
            dists = {d.lower().replace("_", "-") for d in providers.get(name, [name])}
            if not dists & declared:
                missing.setdefault(name, []).append(package)
    assert missing == {}, f"imported but not in pyproject's dependencies: {missing}"
