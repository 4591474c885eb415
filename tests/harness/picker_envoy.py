"""Envoy as ``render`` writes it for ``endpoint_picker`` pools, with a stand-in for extproc's pick.

The stand-in is a test-only Lua filter in place of the ext_proc filter: it does what extproc's
answer does for a picked request (``Continue(lb_endpoints=...)``: the route's pool in
``llm_sidecar.cluster``, the pods in ``envoy.lb``/``x-gateway-destination-endpoint`` and the
header of that name), reading them from the test headers ``x-test-cluster`` and ``x-test-pick``;
it answers with ``x-test-served``, the ``envoy.lb`` pod Envoy says it used.
Everything else (early header removal, routes, retry policies, the pool clusters and their
override_host balancer) is the rendered bootstrap, so the tests see what production Envoy does
with a pick. Each pod is a simulator named ``pod-PORT`` (its ``x-sim-name`` answer header).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import yaml

from routing.loader import load_config
from routing.render import write_all
from sidecar_runtime.process.procs import envoy_binary, sidecar_command, start, wait_http_ok
from sidecar_runtime.wire.names import (
    CLUSTER_METADATA_KEY,
    DESTINATION_ENDPOINT,
    DESTINATION_ENDPOINT_SERVED,
    LB_METADATA_NAMESPACE,
    METADATA_NAMESPACE,
)
from tests.harness.ci import unavailable

TEST_CLUSTER, TEST_PICK, TEST_SERVED = "x-test-cluster", "x-test-pick", "x-test-served"

FAKE_PICKER_LUA = f"""
function envoy_on_request(handle)
  local headers = handle:headers()
  local meta = handle:streamInfo():dynamicMetadata()
  local cluster = headers:get("{TEST_CLUSTER}")
  if cluster then meta:set("{METADATA_NAMESPACE}", "{CLUSTER_METADATA_KEY}", cluster) end
  local pick = headers:get("{TEST_PICK}")
  if pick then
    meta:set("{LB_METADATA_NAMESPACE}", "{DESTINATION_ENDPOINT}", pick)
    headers:replace("{DESTINATION_ENDPOINT}", pick)
  end
  handle:clearRouteCache()
end

function envoy_on_response(handle)
  local lb = handle:streamInfo():dynamicMetadata():get("{LB_METADATA_NAMESPACE}")
  if lb and lb["{DESTINATION_ENDPOINT_SERVED}"] then
    handle:headers():add("{TEST_SERVED}", lb["{DESTINATION_ENDPOINT_SERVED}"])
  end
end
"""


def fake_picker_filter() -> dict[str, Any]:
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": FAKE_PICKER_LUA}}}


def swap_ext_proc_for_fake_picker(bootstrap: dict[str, Any]) -> None:
    """Replace the ext_proc filter of ``bootstrap``'s listener by :func:`fake_picker_filter`."""
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    index = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    filters[index] = fake_picker_filter()


@dataclass
class PickerEnvoy:
    url: str
    admin_url: str

    def chat(self, headers: dict[str, str]) -> tuple[int, str, str]:
        """POST a chat completion with ``headers``: status, the serving pod's name, and the
        pod Envoy recorded as served (``envoy.lb``/``x-gateway-destination-endpoint-served``)."""
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         method="POST",
                                         headers={"content-type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return (resp.status, resp.headers.get("x-sim-name", ""),
                        resp.headers.get(TEST_SERVED, ""))
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("x-sim-name", ""), err.headers.get(TEST_SERVED, "")

    def counter(self, name: str) -> int:
        """One Envoy counter by exact name (0 before it counted anything)."""
        with urllib.request.urlopen(f"{self.admin_url}/stats?filter=^{re.escape(name)}$",
                                    timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        return sum(int(line.rsplit(": ", 1)[1]) for line in lines if ": " in line)

    def host_flags(self, cluster: str) -> dict[str, str]:
        """``ip:port`` → health flags of each host of ``cluster`` (``healthy`` when none)."""
        with urllib.request.urlopen(f"{self.admin_url}/clusters", timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        out: dict[str, str] = {}
        for line in lines:
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
                out[parts[1]] = parts[3]
        return out


def pod_name(port: int) -> str:
    return f"pod-{port}"


def sim_journal(port: int) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/requests", timeout=5) as resp:
        result: list[dict[str, Any]] = json.loads(resp.read())
    return result


@contextmanager
def picker_envoy(doc: dict[str, Any], workdir: str, pods: list[int],
                 patch: Callable[[dict[str, Any]], None] | None = None) -> Iterator[PickerEnvoy]:
    """Simulators on 127.0.0.1 at ``pods`` (ports), and Envoy rendered from ``doc`` with the
    fake picker; ``doc``'s clusters name the pods (or closed ports, or ``localhost``).
    ``patch`` edits the bootstrap first (to try settings ``render`` does not write)."""
    try:
        binary = envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "routing.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle)
    config = load_config(path)
    write_all(config, workdir)
    envoy_yaml = os.path.join(workdir, "envoy.yaml")
    with open(envoy_yaml, encoding="utf-8") as handle:
        bootstrap = yaml.safe_load(handle)
    swap_ext_proc_for_fake_picker(bootstrap)
    if patch is not None:
        patch(bootstrap)
    with open(envoy_yaml, "w", encoding="utf-8") as handle:
        yaml.safe_dump(bootstrap, handle)
    with ExitStack() as stack:
        sims = []
        for port in pods:
            child = start(pod_name(port), sidecar_command(
                "sim", "--port", str(port), "--name", pod_name(port), "--max-model-len", "4096",
                "--decode-ms-per-token", "0.1"),
                log_path=os.path.join(workdir, f"{pod_name(port)}.log"))
            stack.callback(child.stop)
            sims.append((child, port))
        for child, port in sims:
            wait_http_ok(f"http://127.0.0.1:{port}/health", 30, child)
        envoy = start("envoy", [binary, "-c", envoy_yaml, "--log-level", "warn",
                                "--disable-hot-restart"],
                      log_path=os.path.join(workdir, "envoy.log"))
        stack.callback(envoy.stop)
        wait_http_ok(f"http://{config.envoy.admin}/ready", 30, envoy)
        yield PickerEnvoy(url=f"http://{config.envoy.listen}",
                          admin_url=f"http://{config.envoy.admin}")
