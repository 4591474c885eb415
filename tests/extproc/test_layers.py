"""extproc's decisions stay pure: the core (every top-level module but the adapters), the
processors, the picker's choice and the cache's keys and values import no gRPC, Redis, Prometheus,
aiohttp or protobuf, directly or through any module of the project they import.

Only the adapters (``service``, ``wire``, ``rls_client``, ``rls_wire``, ``main``) and the modules
around the core (cache stores and guard, metrics, the picker's scraper) may. A new module at the
top of extproc is core unless it is added to :data:`ADAPTERS`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXTPROC = ROOT / "extproc"
PROJECT = ("extproc", "routing", "sidecar_runtime", "ratelimit", "llm_sidecar", "simulator")
FORBIDDEN = ("grpc", "redis", "prometheus_client", "aiohttp", "envoy", "google.protobuf")

ADAPTERS = {"service", "wire", "rls_client", "rls_wire", "main"}
CORE = sorted(f"extproc.{p.stem}" for p in EXTPROC.glob("*.py")
              if p.stem not in ADAPTERS and p.stem != "__init__")
PURE = [
    *CORE,
    *sorted(f"extproc.processors.{p.stem}" for p in (EXTPROC / "processors").glob("*.py")),
    *(f"extproc.picker.{name}" for name in ("state", "prefix", "scoring", "pick")),
    *(f"extproc.cache.{name}" for name in ("keys", "codec", "merge", "store")),
    *(f"extproc.telemetry.{name}" for name in ("events", "sampling")),
]

# The stream reads a canary's trip state from the guard, a Prometheus-backed telemetry decorator:
# the one way the core still reaches I/O. When the guard becomes a policy the stream is handed,
# this edge goes and so must this entry (test_every_allowed_edge_is_still_needed says when).
ALLOWED_EDGES = {("extproc.stream", "extproc.canary.guard")}


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


def io_reached(module: str, allowed: set[tuple[str, str]]) -> list[str]:
    """The import chains from ``module`` to a forbidden package, through the project's modules."""
    chains: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, tuple[str, ...]]] = [(module, (module,))]
    while stack:
        current, chain = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in sorted(imports_of(current)):
            if is_forbidden(name):
                chains.append(" -> ".join((*chain, name)))
            elif (name.split(".")[0] in PROJECT and source_of(name) is not None
                  and (current, name) not in allowed):
                stack.append((name, (*chain, name)))
    return chains


@pytest.mark.parametrize("module", PURE)
def test_pure_module_reaches_no_io(module: str) -> None:
    assert io_reached(module, ALLOWED_EDGES) == []


@pytest.mark.parametrize("edge", sorted(ALLOWED_EDGES))
def test_every_allowed_edge_is_still_needed(edge: tuple[str, str]) -> None:
    # Also shows the walk follows the project's modules to a library two imports away.
    importer, imported = edge
    assert imported in imports_of(importer)
    assert io_reached(importer, set()) != []


def test_the_lists_name_real_modules() -> None:
    # A misspelt or moved module would otherwise never be checked.
    assert {"extproc.stream", "extproc.bodies", "extproc.decide", "extproc.identity"} <= set(CORE)
    assert "extproc.processors.generation" in PURE
    assert all(source_of(module) is not None for module in PURE)
    assert all(source_of(f"extproc.{name}") is not None for name in ADAPTERS)


def test_an_adapter_is_caught() -> None:
    assert io_reached("extproc.wire", set()) != []
    assert io_reached("extproc.service", set()) != []
