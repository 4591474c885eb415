"""Envoy alone, rendered from a routing YAML, with nothing (or a test's stand-in) behind its
ext_proc address: for what Envoy answers by itself."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from routing.loader import load_config
from routing.render import write_all
from sidecar_runtime.process.procs import envoy_binary, start, wait_http_ok


@contextmanager
def envoy_only(doc: dict[str, Any], workdir: str) -> Iterator[str]:
    """Envoy alone, with nothing behind its ext_proc address; yields its listener's URL."""
    path = os.path.join(workdir, "routing.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle)
    config = load_config(path)
    write_all(config, workdir)
    child = start("envoy", [envoy_binary(), "-c", os.path.join(workdir, "envoy.yaml"),
                            "--log-level", "error", "--disable-hot-restart"])
    try:
        wait_http_ok(f"http://{config.envoy.admin}/ready", 30, child)
        yield f"http://{config.envoy.listen}"
    finally:
        child.stop()


def post(url: str, body: bytes) -> tuple[int, str, dict[str, Any]]:
    """POST ``body`` to ``url``'s chat completions: status, content type, JSON answer."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.headers["content-type"], json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers["content-type"], json.loads(err.read())
