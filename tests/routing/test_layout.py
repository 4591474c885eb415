"""The config model stands alone: ``routing``'s top-level modules (schema, loader, compiled,
ratelimits, ...) never import ``routing.render``, which stands on them and turns a config into
Envoy, Istio, Compose and Kubernetes files. extproc and ratelimit load configs without the
renderers; a renderer change cannot reach how a config is read."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROUTING = pathlib.Path(__file__).resolve().parents[2] / "routing"


def imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODEL = sorted(ROUTING.glob("*.py"))


@pytest.mark.parametrize("path", MODEL, ids=lambda p: p.name)
def test_a_config_module_does_not_import_the_renderers(path: pathlib.Path) -> None:
    assert sorted(name for name in imports(path)
                  if name == "routing.render" or name.startswith("routing.render.")) == []


def test_the_model_and_the_renderers_are_both_there() -> None:
    assert {"schema.py", "loader.py", "compiled.py"} <= {p.name for p in MODEL}
    assert {"envoy.py", "clusters.py", "artifacts.py", "__init__.py"} <= {
        p.name for p in (ROUTING / "render").glob("*.py")}
    assert "routing.render.envoy" in imports(ROUTING / "render" / "__init__.py")
