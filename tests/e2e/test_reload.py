"""Live reload through real Envoy: under steady load, no request fails because of a reload.

extproc and ratelimit both watch the routing YAML. Each change below is waited for until both
have applied it (their ``*_config_reloads_total`` counters), so 20 changes are 20 reloads.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.gateway import Gateway, default_doc, running_gateway

RELOAD_INTERVAL_S = "0.2"


def base_doc() -> dict[str, Any]:
    doc = default_doc()
    doc["models"]["llama-2-13b"]["canary"] = {"model": "llama-2-13b-v2", "cluster": "vllm-canary",
                                              "percent": 0, "sticky": "request"}
    doc["rate_limits"] = {
        "api_key": {"default": {"requests": "10000/s", "tokens": "100M/min"}},
        "tenant": {"default": {"requests": "600000/min"}},
    }
    # No stream read for telemetry (no share, no floor): each one's usage chunk is injected,
    # read by Envoy and stripped by its Lua filter, and every stream must still arrive whole
    # and as asked for (issue 16).
    doc["telemetry"] = {"sample": 0, "sample_min_per_s": 0}
    return doc


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pytest.MonkeyPatch.context() as patch:
        # Both services read this from the environment they inherit.
        patch.setenv("LLM_SIDECAR_RELOAD_INTERVAL_S", RELOAD_INTERVAL_S)
        with running_gateway(base_doc(), str(tmp_path_factory.mktemp("gw-reload"))) as gateway:
            yield gateway


def reloads(metrics_url: str, prefix: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == f"{prefix}_config_reloads":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["result"]] = sample.value
    return out


def counts(gw: Gateway) -> tuple[dict[str, float], dict[str, float]]:
    return reloads(gw.extproc_metrics, "extproc"), reloads(gw.ratelimit_metrics, "ratelimit")


def write_atomically(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        yaml.safe_dump(doc, handle, sort_keys=False)
    os.replace(tmp, path)


def wait_applied(gw: Gateway, result: str, before: tuple[dict[str, float], dict[str, float]],
                 timeout_s: float = 10.0) -> float:
    """Seconds until both services counted one more reload with ``result``."""
    started = time.monotonic()
    while True:
        now = counts(gw)
        if all(n.get(result, 0) > b.get(result, 0) for n, b in zip(now, before, strict=True)):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, (before, now)
        time.sleep(0.02)


def change(gw: Gateway, doc: dict[str, Any], timeout_s: float = 10.0) -> float:
    before = counts(gw)
    write_atomically(gw.config_path, doc)
    return wait_applied(gw, "ok", before, timeout_s)


@dataclass
class Load:
    """Client threads sending chat (plain and streamed) and embeddings until stopped."""

    gw: Gateway
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    pools: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, conn: http.client.HTTPConnection, i: int) -> None:
        kind = i % 3
        body: dict[str, object]
        if kind == 2:
            path, body = "/v1/embeddings", {"model": "bge-m3", "input": [f"text {i}"]}
        else:
            path, body = "/v1/chat/completions", {
                "model": "llama-2-13b", "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 30, "stream": kind == 1}
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json",
                                                     "authorization": f"Bearer sk-load-{i % 7}"})
        resp = conn.getresponse()
        data = resp.read()
        pool = resp.getheader("x-sim-name", "?")
        problem = None
        if resp.status != 200:
            problem = f"{path} {resp.status} {data[:300]!r}"
        elif kind == 1 and (data.count(b"data: ") < 31 or not data.rstrip().endswith(b"[DONE]")):
            problem = f"stream cut short: {data[-200:]!r}"
        elif kind == 1 and b'"choices":[]' in data:
            problem = f"a usage chunk the client did not ask for: {data[-300:]!r}"
        with self.lock:
            if problem:
                self.failures.append(problem)
            else:
                self.ok += 1
                self.pools[pool] = self.pools.get(pool, 0) + 1

    def worker(self, n: int) -> None:
        host, port = self.gw.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        i = n
        while not self.stop.is_set():
            try:
                self.request(conn, i)
            except (OSError, http.client.HTTPException) as exc:
                with self.lock:
                    self.failures.append(f"connection: {exc!r}")
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
            i += 4

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self.worker, args=(n,)) for n in range(4)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def models(gw: Gateway) -> list[str]:
    with urllib.request.urlopen(f"{gw.openai_base}/models", timeout=5) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def test_twenty_reloads_under_load_fail_no_request(gw: Gateway) -> None:
    doc = base_doc()
    steps: list[dict[str, Any]] = []
    for i in range(20):
        doc = copy.deepcopy(doc)
        match i % 4:
            case 0:
                doc["rate_limits"]["api_key"]["default"]["requests"] = f"{10000 + i}/s"
            case 1:
                doc["models"]["llama-2-13b"]["canary"]["percent"] = [30, 100, 0, 50, 100][i // 4]
            case 2:
                doc["models"][f"new-model-{i}"] = {"clusters": ["vllm-long"]}
            case _:
                doc["rate_limits"]["tenant"]["default"]["tokens"] = f"{i}M/min"
        steps.append(doc)
    with Load(gw) as load:
        time.sleep(0.3)
        applied = []
        for step in steps:
            applied.append(change(gw, step))
            time.sleep(0.05)  # let requests run on each config
    assert load.failures == []
    assert load.ok > 100, load.ok
    assert sorted(applied)[len(applied) // 2] < 2.0, applied  # the typical reload is quick
    # The canary percent changes were live: some requests went to the canary pool.
    assert load.pools.get("vllm-canary", 0) > 0, load.pools
    assert "new-model-18" in models(gw)
    change(gw, base_doc())  # counts before the write: a quick reload must not be missed


def test_a_broken_file_changes_nothing(gw: Gateway) -> None:
    broken = base_doc()
    broken["models"]["ghost"] = {"clusters": ["no-such-pool"]}
    before = counts(gw)
    with Load(gw) as load:
        time.sleep(0.2)
        write_atomically(gw.config_path, broken)
        wait_applied(gw, "error", before)
        time.sleep(0.3)
    assert load.failures == [] and load.ok > 10
    assert "ghost" not in models(gw)
    after = counts(gw)
    assert [c.get("ok", 0) for c in after] == [c.get("ok", 0) for c in before]
    change(gw, base_doc())


def test_a_configmap_symlink_swap_applies(gw: Gateway) -> None:
    """The kubelet's layout: routing.yaml → ..data/routing.yaml, ..data → a timestamped dir."""
    workdir = os.path.dirname(gw.config_path)

    def publish(version: int, doc: dict[str, Any]) -> None:
        stamp = os.path.join(workdir, f"..2026_01_01_00_00_0{version}")
        os.mkdir(stamp)
        with open(os.path.join(stamp, "routing.yaml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(doc, handle, sort_keys=False)
        os.symlink(os.path.basename(stamp), os.path.join(workdir, "..data_tmp"))
        os.replace(os.path.join(workdir, "..data_tmp"), os.path.join(workdir, "..data"))

    publish(1, base_doc())
    before = counts(gw)
    os.symlink("..data/routing.yaml", f"{gw.config_path}.link")
    os.replace(f"{gw.config_path}.link", gw.config_path)
    wait_applied(gw, "ok", before)  # the path now resolves elsewhere: one reload, same config

    swapped = base_doc()
    swapped["models"]["swapped-in"] = {"clusters": ["vllm-long"]}
    started = time.monotonic()
    before = counts(gw)
    publish(2, swapped)
    wait_applied(gw, "ok", before)
    assert "swapped-in" in models(gw)
    # The docs' "within 2 s" is at the default 0.5 s poll; at this rig's 0.2 s it takes ~0.5 s.
    # The typical reload is asserted as a median above; one reload only gets a margin that a
    # loaded machine always meets.
    took = time.monotonic() - started
    print(f"\n[reload] a ConfigMap symlink swap applied in {took:.2f} s")
    assert took < 5.0
