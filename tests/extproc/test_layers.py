"""extproc's decisions stay pure: the core (every top-level module of ``extproc``), the
processors, the picker's choice and the cache's keys and values import no gRPC, Redis, Prometheus,
aiohttp or protobuf, directly or through any module of the project they import.

Only the adapters (``extproc/adapters/``: ``service``, ``ext_proc_pb``, ``rls_client``,
``rls_pb``, ``main``) and the modules around the core (cache stores, metrics, the picker's
scraper) may. A new module at the top of extproc is core; one that needs I/O goes in adapters.

The core and the processors report nothing either: they return what happened as values
(:mod:`extproc.records`) and the service hands them to telemetry, so they reach no module of
``extproc.telemetry`` (nor the canary guard, a telemetry decorator). Which responses are read
(:mod:`extproc.sampling`) is a decision of the core, not telemetry.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXTPROC = ROOT / "extproc"
PROJECT = ("extproc", "routing", "sidecar_runtime", "ratelimit", "llm_sidecar", "simulator")
FORBIDDEN = ("grpc", "redis", "prometheus_client", "aiohttp", "envoy", "google.protobuf")

ADAPTERS = sorted(f"extproc.adapters.{p.stem}" for p in (EXTPROC / "adapters").glob("*.py")
                  if p.stem != "__init__")
CORE = sorted(f"extproc.{p.stem}" for p in EXTPROC.glob("*.py") if p.stem != "__init__")
PROCESSORS = sorted(f"extproc.processors.{p.stem}" for p in (EXTPROC / "processors").glob("*.py"))
PURE = [
    *CORE,
    *PROCESSORS,
    *(f"extproc.picker.{name}" for name in ("state", "prefix", "scoring", "pick")),
    *(f"extproc.cache.{name}" for name in ("keys", "codec", "merge", "store")),
    "extproc.telemetry.events",
]


def source_of(module: str) -> pathlib.Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def imports_of(module: str) -> set[str]:
    """Every absolute module ``module`` imports, lazy imports inside functions included;
    ``from a import b`` gives ``a.b`` too when ``b`` is a module of the project."""
    path = source_of(module)
    assert path is not None, module
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if source_of(f"{node.module}.{alias.name}") is not None)
    return found


def is_forbidden(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


def reports(name: str) -> bool:
    """Is ``name`` a module that reports to telemetry (or is telemetry)?"""
    return (name == "extproc.telemetry" or name.startswith("extproc.telemetry.")
            or name == "extproc.canary.guard")


def io_reached(module: str, bad: Callable[[str], bool] = is_forbidden) -> list[str]:
    """The import chains from ``module`` to a ``bad`` module (by default a forbidden package),
    through the project's modules."""
    chains: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, tuple[str, ...]]] = [(module, (module,))]
    while stack:
        current, chain = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in sorted(imports_of(current)):
            if bad(name):
                chains.append(" -> ".join((*chain, name)))
            elif name.split(".")[0] in PROJECT and source_of(name) is not None:
                stack.append((name, (*chain, name)))
    return chains


@pytest.mark.parametrize("module", PURE)
def test_pure_module_reaches_no_io(module: str) -> None:
    assert io_reached(module) == []


@pytest.mark.parametrize("module", [*CORE, *PROCESSORS])
def test_core_module_reaches_no_telemetry(module: str) -> None:
    assert io_reached(module, reports) == []


def test_the_walk_follows_the_projects_modules() -> None:
    # A library two imports away is found (the guard reaches Redis only through the runtime),
    # and so is telemetry behind a module that does not name it.
    assert not any(is_forbidden(name) for name in imports_of("extproc.cache.shielded"))
    assert io_reached("extproc.cache.shielded") != []
    assert io_reached("extproc.adapters.service", reports) != []
    assert io_reached("extproc.canary.report", reports) == []  # reads metrics text only
    assert reports("extproc.telemetry.events") and not reports("extproc.sampling")


def test_the_lists_name_real_modules() -> None:
    # A misspelt or moved module would otherwise never be checked.
    assert {"extproc.stream", "extproc.bodies", "extproc.decide", "extproc.identity"} <= set(CORE)
    assert "extproc.processors.generation" in PURE and "extproc.records" in CORE
    assert "extproc.sampling" in CORE
    assert all(source_of(module) is not None for module in PURE)
    assert set(ADAPTERS) == {f"extproc.adapters.{name}" for name in
                             ("service", "ext_proc_pb", "rls_client", "rls_pb", "main")}


def test_an_adapter_is_caught() -> None:
    assert io_reached("extproc.adapters.ext_proc_pb") != []
    assert io_reached("extproc.adapters.service") != []
