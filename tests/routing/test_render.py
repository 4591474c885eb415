"""Every config ``render`` writes must pass ``envoy --mode validate``."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from llm_sidecar.procs import envoy_binary
from llm_sidecar.up import example_config_path
from routing.loader import load_config
from routing.render import write_all
from tests.harness.ci import unavailable
from tests.harness.gateway import default_doc


def validate(path: pathlib.Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    result = subprocess.run([envoy, "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def variants() -> dict[str, dict[str, object]]:
    docs: dict[str, dict[str, object]] = {}
    docs["test-default"] = default_doc()
    dns = default_doc()
    dns["clusters"]["vllm-long"]["endpoints"] = ["vllm-long.llm.svc:8000",  # type: ignore[index]
                                                 "vllm-long-2.llm.svc:8000"]
    dns["services"] = {"extproc": "extproc.llm.svc:50051", "ratelimit": "[::1]:50052",
                       "failure_mode_allow": True}
    docs["dns-and-fail-open"] = dns
    return docs


@pytest.mark.parametrize("name", ["example", *variants()])
def test_rendered_envoy_config_validates(name: str, tmp_path: pathlib.Path) -> None:
    if name == "example":
        config = load_config(example_config_path())
    else:
        source = tmp_path / "routing.yaml"
        source.write_text(yaml.safe_dump(variants()[name]))
        config = load_config(str(source))
    written = write_all(config, str(tmp_path / "out"))
    for path in written:
        if path.endswith("envoy.yaml"):
            validate(pathlib.Path(path))
