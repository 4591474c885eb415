"""``llm-sidecar render``: write every artifact derived from one routing YAML."""

from __future__ import annotations

import os

import yaml

from routing.ratelimits import descriptors
from routing.render_envoy import bootstrap
from routing.schema import RoutingConfig


def dump(doc: object) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)


def render_all(config: RoutingConfig) -> dict[str, str]:
    """File name → text of each artifact."""
    return {
        "envoy.yaml": dump(bootstrap(config)),
        "ratelimit.yaml": dump(descriptors(config)),
    }


def write_all(config: RoutingConfig, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in render_all(config).items():
        path = os.path.join(out_dir, name)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
        written.append(path)
    return written
