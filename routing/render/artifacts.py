"""The checked-in files derived from the example config, and the one command that rewrites them.

``python -m routing.render.artifacts`` rewrites them all; ``--check`` lists the stale ones and exits 1
(the test suite runs the same check). What it writes, from ``llm_sidecar/example.yaml``:

- ``envoy/``: exactly what ``llm-sidecar render`` writes for the example config;
- ``llm_sidecar/llm-sidecar.schema.json``: the JSON Schema the example's first line points at;
- ``deploy/compose/routing.yaml`` and ``docker-compose.yml``: the example in containers;
- ``deploy/k8s/*.yaml``: the example on Kubernetes (the routing YAML is its ConfigMap).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib import resources
from typing import Any

import yaml

from routing.jsonschema import SCHEMA_FILE, schema_text
from routing.loader import load_config
from routing.render import dump, render_all
from routing.render.deploy import compose, container_doc, kubernetes
from sidecar_runtime.process.files import generate, stale_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = "llm_sidecar/example.yaml"
COMMAND = "python -m routing.render.artifacts"
COMPOSE_ROUTING = "deploy/compose/routing.yaml"


def _generated(what: str) -> str:
    return f"# Generated from {EXAMPLE} by `{COMMAND}`; edit that file and run it again.\n# {what}\n"


def artifacts() -> dict[str, str]:
    """Path relative to the repository → the text it must hold."""
    example_path = str(resources.files("llm_sidecar").joinpath("example.yaml"))
    config = load_config(example_path)
    with open(example_path, encoding="utf-8") as handle:
        raw: dict[str, Any] = yaml.safe_load(handle)
    files = {f"envoy/{name}": text for name, text in render_all(config).items()}
    files[f"llm_sidecar/{SCHEMA_FILE}"] = schema_text()
    deployed = dump(container_doc(raw, config))
    files[COMPOSE_ROUTING] = (
        f"# yaml-language-server: $schema=../../llm_sidecar/{SCHEMA_FILE}\n"
        + _generated("The example config with container addresses; docker-compose.yml mounts "
                     "this directory.") + deployed)
    files["docker-compose.yml"] = _generated(
        "`docker compose up --build`, then an OpenAI client at http://localhost:10000/v1. "
        "Edit deploy/compose/routing.yaml while it runs: extproc and ratelimit reload it.") + dump(
        compose(config, COMPOSE_ROUTING))
    configmap_text = _generated("The routing YAML of the gateway.") + deployed
    manifests = kubernetes(config, configmap_text)
    for name, docs in manifests.items():
        files[f"deploy/k8s/{name}"] = _generated(
            "kubectl apply -k deploy/k8s/ (build the image from Dockerfile first).") + "---\n".join(
            dump(doc) for doc in docs)
    files["deploy/k8s/kustomization.yaml"] = _generated("kubectl apply -k deploy/k8s/") + dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": list(manifests)})
    return files


def stale(root: str = ROOT) -> list[str]:
    """Paths whose content differs from what :func:`artifacts` makes (missing ones included)."""
    return stale_files(artifacts(), root)


def main(argv: Sequence[str] | None = None) -> int:
    return generate(sys.argv[1:] if argv is None else argv, artifacts, ROOT, COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
