"""What real Envoy does with a pick on an ``endpoint_picker`` pool (docs/concepts/picker.md).

Envoy is the rendered bootstrap with a Lua stand-in for extproc's pick (tests/harness/
picker_envoy.py). Pods: three simulators (A, B, C), a closed port (D) listed in the pool and
so failing its health checks, and a simulator (E) outside every pool. ``pool`` lists them by
IP (a STATIC cluster); ``dnspool`` lists A and B as ``localhost:PORT`` (STRICT_DNS, as a
headless Service's name would be).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sidecar_runtime.process.procs import free_port
from tests.harness.gateway import ip
from tests.harness.picker_envoy import (
    TEST_CLUSTER,
    TEST_PICK,
    PickerEnvoy,
    picker_envoy,
    pod_name,
    sim_journal,
)

A, B, C, D, E = (free_port() for _ in range(5))
ALL = (A, B, C)


def doc() -> dict[str, Any]:
    return {
        "version": 1,
        "envoy": {"listen": ip(free_port()), "admin": ip(free_port())},
        "services": {"extproc": ip(free_port())},
        "clusters": {
            "pool": {"endpoints": [ip(p) for p in (A, B, C, D)], "max_context": 4096,
                     "endpoint_picker": {}},
            "dnspool": {"endpoints": [f"localhost:{p}" for p in (A, B)], "max_context": 8192,
                        "endpoint_picker": {}},
        },
        "models": {"m": {"clusters": ["pool", "dnspool"]}},
    }


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerEnvoy]:
    with picker_envoy(doc(), str(tmp_path_factory.mktemp("picker")), [A, B, C, E]) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def d_is_down(envoy: PickerEnvoy) -> None:
    """Wait until Envoy's health checks hold D down and A, B, C up (the state every test
    below starts from); a first check fails a host at once."""
    def settled() -> bool:
        flags = envoy.host_flags("pool")
        return ("failed_active_hc" in flags.get(ip(D), "")
                and all(flags.get(ip(p)) == "healthy" for p in ALL))
    wait_for(settled)


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll until ``condition()``; the 60 s only ends a test that would otherwise hang."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "condition not met in 60 s"
        time.sleep(0.05)


def send(envoy: PickerEnvoy, n: int, cluster: str = "pool", **headers: str) -> Counter[str]:
    """``n`` requests to ``cluster``: how many each pod served (all must succeed, and Envoy's
    ``x-gateway-destination-endpoint-served`` must name the pod that answered)."""
    served: Counter[str] = Counter()
    for _ in range(n):
        status, pod, recorded = envoy.chat({TEST_CLUSTER: cluster, **headers})
        assert status == 200, (status, pod)
        assert pod == pod_name(int(recorded.rsplit(":", 1)[1])), (pod, recorded)
        served[pod] += 1
    return served


def retries(envoy: PickerEnvoy) -> int:
    return envoy.counter("cluster.pool.upstream_rq_retry")


@pytest.mark.usefixtures("d_is_down")
def test_a_picked_pod_gets_every_request(envoy: PickerEnvoy) -> None:
    """(a) metadata naming a pod: that pod, every time, never another."""
    for port in ALL:
        assert send(envoy, 8, **{TEST_PICK: ip(port)}) == {pod_name(port): 8}


@pytest.mark.usefixtures("d_is_down")
def test_without_a_pick_least_request_spreads_over_the_healthy_pods(envoy: PickerEnvoy) -> None:
    """(b) no metadata: the fallback balancer (least request) uses the healthy pods, and
    never the one failing its health checks (no connect failure, no retry)."""
    before = retries(envoy)
    served = send(envoy, 30)
    assert set(served) <= {pod_name(p) for p in ALL} and len(served) >= 2, served
    assert retries(envoy) == before


@pytest.mark.usefixtures("d_is_down")
@pytest.mark.parametrize("pick", [f"127.0.0.1:{E}", "10.255.255.1:8000", "not-an-address",
                                  "", f"localhost:{A}"])
def test_a_pod_outside_the_pool_is_never_reached(envoy: PickerEnvoy, pick: str) -> None:
    """(c) an address not in the cluster (a live server included), a malformed value, or a
    host name: skipped, the fallback balancer serves; Envoy never connects outside the pool."""
    served = send(envoy, 6, **{TEST_PICK: pick})
    assert set(served) <= {pod_name(p) for p in ALL}, served
    assert sim_journal(E) == []


@pytest.mark.usefixtures("d_is_down")
@pytest.mark.parametrize(("listed", "expected", "retried"), [
    ((D, B), B, 1),      # the pick refuses connections: the retry takes the next listed pod
    ((A, B), A, 0),      # a list whose first pod answers: only that one
    # A repeat is tried again: previous_hosts does not apply to listed pods, only to the
    # fallback balancer (extproc.adapters.ext_proc_pb sends each pod once).
    ((D, D, C), C, 2),
])
def test_a_retry_goes_down_the_list(envoy: PickerEnvoy, listed: tuple[int, ...], expected: int,
                                    retried: int) -> None:
    """(d) the route's retry on connect-failure takes the next pod of the list; D is tried
    first although its health checks fail (override_host does not look at health)."""
    before = retries(envoy)
    pick = ",".join(ip(p) for p in listed)
    assert send(envoy, 3, **{TEST_PICK: pick}) == {pod_name(expected): 3}
    assert retries(envoy) - before == 3 * retried


@pytest.mark.usefixtures("d_is_down")
def test_a_list_used_up_by_retries_falls_back_to_a_healthy_pod(envoy: PickerEnvoy) -> None:
    """(d) only the dead pod listed: the retry finds the list used up, and least request
    (with previous_hosts) takes a healthy pod rather than failing the request."""
    before = retries(envoy)
    served = send(envoy, 6, **{TEST_PICK: ip(D)})
    assert set(served) <= {pod_name(p) for p in ALL}, served
    assert retries(envoy) - before == 6


@pytest.mark.usefixtures("d_is_down")
def test_a_dns_pool_matches_the_resolved_address(envoy: PickerEnvoy) -> None:
    """(e) STRICT_DNS (``localhost:PORT`` endpoints): the pick names the resolved IP:port."""
    for port in (A, B):
        assert send(envoy, 5, "dnspool", **{TEST_PICK: ip(port)}) == {pod_name(port): 5}
    # C is a live pod of the other pool, not of this one.
    served = send(envoy, 5, "dnspool", **{TEST_PICK: ip(C)})
    assert set(served) <= {pod_name(A), pod_name(B)}, served


@pytest.mark.usefixtures("d_is_down")
def test_a_client_header_neither_steers_nor_reaches_a_pod(envoy: PickerEnvoy) -> None:
    """(f) a client's own ``x-gateway-destination-endpoint`` (and ``-subset``) is removed
    before any filter: the balancer reads metadata only, and a pod sees only the pick."""
    client = {"x-gateway-destination-endpoint": ip(C),
              "x-gateway-destination-endpoint-subset": ip(C)}
    for port in ALL:
        sim_clear(port)
    served = send(envoy, 30, **client)
    assert served[pod_name(C)] < 30, served
    assert send(envoy, 5, **client, **{TEST_PICK: ip(A)}) == {pod_name(A): 5}
    seen = [entry["headers"] for port in ALL for entry in sim_journal(port)]
    assert len(seen) == 35
    assert not any("x-gateway-destination-endpoint-subset" in h for h in seen)
    picked = [h.get("x-gateway-destination-endpoint") for h in seen]
    assert picked.count(ip(A)) == 5 and picked.count(None) == 30, picked


def sim_clear(port: int) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/sim/requests", method="DELETE")
    with urllib.request.urlopen(request, timeout=5):
        pass


# -- settings render does not write, tried so the docs can say what they do ------------------

F, G, X = free_port(), free_port(), free_port()
"""F and G: simulators; X: a pod that passes its health checks but answers every request 503,
so outlier detection ejects it (``consecutive_gateway_failure: 3``)."""


class _Failing(BaseHTTPRequestHandler):
    hits = 0

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status = 200 if self.path == "/health" else 503
        if status == 503:
            _Failing.hits += 1
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


def with_override_host_status(bootstrap: dict[str, Any]) -> None:
    """The pool's ``common_lb_config.override_host_status``: only HEALTHY and DEGRADED hosts
    may be overrides (what the stateful session filter's overrides obey)."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == "pool":
            cluster["common_lb_config"] = {
                "override_host_status": {"statuses": ["HEALTHY", "DEGRADED"]}}


@pytest.fixture(scope="module")
def strict_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerEnvoy]:
    """Pool F, G, D (closed) and X (503s), with :func:`with_override_host_status`; D down.
    Its own pods: the module's first Envoy still holds A, B and C."""
    server = ThreadingHTTPServer(("127.0.0.1", X), _Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = doc()
    config["clusters"] = {"pool": {"endpoints": [ip(p) for p in (F, G, D, X)],
                                   "max_context": 4096, "endpoint_picker": {}}}
    config["models"] = {"m": {"clusters": ["pool"]}}
    try:
        with picker_envoy(config, str(tmp_path_factory.mktemp("strict")), [F, G],
                          patch=with_override_host_status) as proxy:
            wait_for(lambda: "failed_active_hc" in proxy.host_flags("pool").get(ip(D), ""))
            yield proxy
    finally:
        server.shutdown()
        server.server_close()


def test_override_host_status_does_not_keep_a_pick_off_an_unhealthy_pod(
        strict_envoy: PickerEnvoy) -> None:
    """``override_host_status`` applies to the stateful session filter's override, not to the
    override_host balancer: D, failing its health checks, is still connected to first."""
    fails = strict_envoy.counter("cluster.pool.upstream_cx_connect_fail")
    tried = strict_envoy.counter("cluster.pool.upstream_rq_retry")
    assert send(strict_envoy, 3, **{TEST_PICK: f"{ip(D)},{ip(G)}"}) == {pod_name(G): 3}
    assert strict_envoy.counter("cluster.pool.upstream_cx_connect_fail") - fails == 3
    assert strict_envoy.counter("cluster.pool.upstream_rq_retry") - tried == 3


def test_an_outlier_ejected_pod_is_still_picked(strict_envoy: PickerEnvoy) -> None:
    """X answers 503 (not retried: the route retries connect failures and resets only); after
    three, outlier detection ejects it, and a pick still sends the next request there."""
    pick = {TEST_CLUSTER: "pool", TEST_PICK: f"{ip(X)},{ip(G)}"}
    for _ in range(3):
        assert strict_envoy.chat(pick)[0] == 503
    wait_for(lambda: "failed_outlier_check" in strict_envoy.host_flags("pool").get(ip(X), ""))
    hits = _Failing.hits
    assert strict_envoy.chat(pick)[0] == 503
    assert _Failing.hits == hits + 1
