"""sidecar_runtime is a leaf: the services, the config package and the CLI stand on it, never the
other way round (a second copy of a mechanism drifts; a runtime that imports a service is a cycle).

The imports are read with ``ast``, so a lazy import inside a function counts as much as one at the
top of a module.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "sidecar_runtime"
FORBIDDEN = ("extproc", "ratelimit", "routing", "simulator", "llm_sidecar")


def imported_modules(source: str) -> set[str]:
    """Every absolute module a source imports (``from a.b import c`` gives ``a.b`` and
    ``a.b.c``: ``c`` may be a submodule); relative imports stay inside the package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def forbidden(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in packages)


@pytest.mark.parametrize("path", sorted(RUNTIME.glob("**/*.py")), ids=lambda p: p.name)
def test_runtime_module_imports_no_service_config_or_cli(path: pathlib.Path) -> None:
    assert forbidden(imported_modules(path.read_text()), FORBIDDEN) == []


def test_the_walk_sees_every_kind_of_import() -> None:
    # The check above can only fail if the walk finds these forms, lazy ones included.
    source = ("import extproc.stream\n"
              "from ratelimit import service\n"
              "def later() -> None:\n"
              "    from llm_sidecar.cli import main\n"
              "from . import logs\n")
    assert forbidden(imported_modules(source), FORBIDDEN) == [
        "extproc.stream", "llm_sidecar.cli", "llm_sidecar.cli.main", "ratelimit",
        "ratelimit.service"]


def test_the_runtime_is_all_there() -> None:
    # A glob that matched nothing would pass the parametrized test vacuously.
    names = {str(p.relative_to(RUNTIME).with_suffix("")) for p in RUNTIME.glob("**/*.py")}
    assert {"process/settings", "process/logs", "redis/breaker", "redis/client", "process/reload",
            "process/grpc_listen", "process/ops_http", "process/workers", "wire/names",
            "process/signals", "process/service_process", "redis/shield", "h2grpc/server",
            "compat/redis_internals"} <= names


def test_the_runtime_is_grouped() -> None:
    # Every module lives in a group (redis, process, wire, h2grpc, compat): a newcomer finds a
    # mechanism by what it is about, and a loose module at the top is a layout that drifted.
    loose = sorted(p.name for p in RUNTIME.glob("*.py") if p.name != "__init__.py")
    assert loose == []
