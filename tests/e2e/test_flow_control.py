"""Flow control end to end (issue 37; docs: Flow control): openai SDK → real Envoy → extproc, which
holds a request while every pod is full and releases it to a pod with room → simulated vLLM.

Pods A and B report themselves full through ``POST /sim/state`` (running at their 4 slots, 2
waiting) without being loaded, and get room back when the override is cleared (all 4 slots) or
set to 3 running (one slot). Each pod's journal says which requests reached it, in order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from sidecar_runtime.process.procs import Child, free_port, sidecar_command, start, wait_http_ok
from tests.harness.gateway import Gateway, ip, running_gateway
from tests.harness.waits import wait_for

A, B = free_port(), free_port()
PODS = (A, B)
SLOTS = 4
FULL = {"running": SLOTS, "waiting": 2}
ONE_SLOT = {"running": SLOTS - 1}
MAX_WAIT_S = 4
LONG_ASK = "word " * 400  # with max_tokens 4000: weight 1600, low priority


def doc() -> dict[str, Any]:
    return {
        "version": 1,
        "envoy": {"listen": ip(free_port()), "admin": ip(free_port())},
        "services": {"extproc": ip(free_port()), "ratelimit": ip(free_port()),
                     "ratelimit_timeout_s": 2.0},
        "clusters": {"pool": {
            "endpoints": [ip(p) for p in PODS], "max_context": 8192,
            # Every answer is 8 tokens (natural stop), whatever max_tokens allows.
            "simulate": {"decode_ms_per_token": 1, "max_num_seqs": SLOTS,
                         "default_output_tokens": 8, "natural_stop": True},
            "endpoint_picker": {"metrics_interval": "50ms", "stale_after": "1s",
                                "flow_control": {"max_wait": f"{MAX_WAIT_S}s",
                                                 "retry_after_s": 2}}}},
        "models": {"m": {"clusters": ["pool"], "default_max_tokens": 8}},
        "priority": {"high_below": 50, "low_from": 1000},
        # A cap of one in flight and a token bucket for the tenants of the hang-up test.
        "rate_limits": {"tenant": {"overrides": {
            name: {"tokens": "100000/min", "concurrent": 1} for name in ("leaver", "newcomer")}}},
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(doc(), str(tmp_path_factory.mktemp("flow"))) as gw:
        yield gw


@pytest.fixture(autouse=True)
def clean_pods(gateway: Gateway) -> Iterator[None]:
    for port in PODS:
        sim_state(port, {})
    for port in PODS:
        wait_for(reads(gateway, "running", port, 0), timeout=10,
                 what=f"extproc to see pod {port} idle")
    wait_for(lambda: total_depth(gateway) == 0, timeout=10, what="no request waiting")
    clear_journals()
    yield
    for port in PODS:
        sim_state(port, {})


def sim_state(port: int, state: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{ip(port)}/sim/state",
                                     data=json.dumps(state).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        view: dict[str, Any] = json.loads(resp.read())
    return view


def journal(port: int) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{ip(port)}/sim/requests", timeout=5) as resp:
        entries: list[dict[str, Any]] = json.loads(resp.read())
    return [e for e in entries if e["path"] == "/v1/chat/completions"]


def clear_journals(ports: tuple[int, ...] = PODS) -> None:
    for port in ports:
        request = urllib.request.Request(f"http://{ip(port)}/sim/requests", method="DELETE")
        with urllib.request.urlopen(request, timeout=5):
            pass


def metrics_text(gateway: Gateway) -> str:
    with urllib.request.urlopen(f"{gateway.extproc_metrics}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def endpoint_gauge(gateway: Gateway, what: str, port: int) -> float | None:
    pattern = rf'^llm_sidecar_endpoint_{what}\{{[^}}]*endpoint="{re.escape(ip(port))}"[^}}]*\}} (\S+)$'
    match = re.search(pattern, metrics_text(gateway), re.MULTILINE)
    return float(match.group(1)) if match else None


def reads(gateway: Gateway, what: str, port: int, value: float) -> Callable[[], bool]:
    """extproc's last scrape of ``port`` shows ``value`` for gauge ``what``."""
    return lambda: endpoint_gauge(gateway, what, port) == value


def flow_metric(gateway: Gateway, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics_text(gateway).splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def depth(gateway: Gateway, priority: str) -> float:
    return flow_metric(gateway, "llm_sidecar_flow_queue_depth", priority=priority)


def total_depth(gateway: Gateway) -> float:
    return flow_metric(gateway, "llm_sidecar_flow_queue_depth")


def fill(gateway: Gateway, ports: tuple[int, ...] = PODS) -> None:
    """Make ``ports`` report themselves full, and wait until extproc has read it."""
    for port in ports:
        sim_state(port, FULL)
    for port in ports:
        wait_for(reads(gateway, "queue", port, FULL["waiting"]), timeout=10,
                 what=f"extproc to read pod {port} full")


def client(gateway: Gateway, tenant: str = "acme", timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.openai_base, api_key="k", max_retries=0,
                         timeout=timeout, default_headers={"x-tenant-id": tenant})


def ask(c: openai.OpenAI, text: str, max_tokens: int = 4) -> Any:
    return c.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens)


def contents(port: int) -> list[str]:
    return [str(e["body"]["messages"][0]["content"]) for e in journal(port)]


@contextlib.contextmanager
def background() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        yield pool


def test_a_request_waits_while_every_pod_is_full_and_goes_when_one_has_room(
        gateway: Gateway) -> None:
    fill(gateway)
    with background() as pool:
        waiting = pool.submit(ask, client(gateway), "waiting one")
        wait_for(lambda: depth(gateway, "high") == 1, timeout=10, what="the request to wait")
        assert journal(A) == [] and journal(B) == []  # nothing reached a pod meanwhile
        assert not waiting.done()
        sim_state(A, {})  # A has room again
        answer = waiting.result(timeout=30)
    assert answer.status_code == 200
    assert int(answer.headers["x-llm-queued-ms"]) >= 0
    assert contents(A) == ["waiting one"] and journal(B) == []
    assert total_depth(gateway) == 0


def test_max_wait_answers_503_with_retry_after_and_nothing_reaches_a_pod(
        gateway: Gateway) -> None:
    fill(gateway)
    refused = flow_metric(gateway, "llm_sidecar_flow_rejected_total", reason="max_wait")
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client(gateway), "too late")
    err = caught.value
    assert err.status_code == 503
    assert err.response.headers["retry-after"] == "2"
    # It waited its max_wait (a lower bound only: a busy machine only makes it later).
    assert int(err.response.headers["x-llm-queued-ms"]) >= MAX_WAIT_S * 1000 - 100
    body = err.response.json()["error"]
    assert body["code"] == "server_overloaded" and body["type"] == "server_error"
    assert journal(A) == [] and journal(B) == []
    assert flow_metric(gateway, "llm_sidecar_flow_rejected_total",
                       reason="max_wait") == refused + 1


def test_a_low_request_waits_instead_of_being_shed(gateway: Gateway) -> None:
    """Without flow control a low request to a full pool is shed at once (503); with it, it
    waits for room like the others."""
    fill(gateway)
    with background() as pool:
        low = pool.submit(ask, client(gateway), LONG_ASK, 4000)
        wait_for(lambda: depth(gateway, "low") == 1, timeout=10, what="the low request to wait")
        sim_state(B, {})
        assert low.result(timeout=30).status_code == 200


def test_high_goes_before_low_that_waited_longer(gateway: Gateway) -> None:
    fill(gateway)
    with background() as pool:
        low = pool.submit(ask, client(gateway, "t-low"), LONG_ASK, 4000)
        wait_for(lambda: depth(gateway, "low") == 1, timeout=10, what="the low request to wait")
        high = pool.submit(ask, client(gateway, "t-high"), "urgent")
        wait_for(lambda: depth(gateway, "high") == 1, timeout=10, what="the high one to wait")
        sim_state(A, ONE_SLOT)  # room for one request at a time, on A only
        assert high.result(timeout=30).status_code == 200
        assert low.result(timeout=30).status_code == 200
    assert contents(A) == ["urgent", LONG_ASK] and journal(B) == []


def test_a_tenant_with_one_waiting_goes_before_a_tenant_with_eight_is_done(
        gateway: Gateway) -> None:
    fill(gateway)
    with background() as pool:
        loud = [pool.submit(ask, client(gateway, "loud"), f"loud {i}") for i in range(8)]
        wait_for(lambda: depth(gateway, "high") == 8, timeout=15, what="eight loud waiting")
        quiet = pool.submit(ask, client(gateway, "quiet"), "quiet 0")
        wait_for(lambda: depth(gateway, "high") == 9, timeout=10, what="the quiet one waiting")
        sim_state(A, ONE_SLOT)
        statuses = [f.result(timeout=60).status_code for f in (*loud, quiet)]
    assert statuses == [200] * 9
    served = contents(A)
    # Released one at a time (two when a scrape lands while one runs): the quiet tenant's
    # request goes after at most two of the eight loud ones that came before it.
    assert served.index("quiet 0") <= 2, served


def test_a_client_that_hangs_up_while_waiting_is_charged_nothing_and_keeps_no_slot(
        gateway: Gateway) -> None:
    fill(gateway)
    abandoned = flow_metric(gateway, "llm_sidecar_flow_abandoned_total")
    with pytest.raises(openai.APITimeoutError):
        ask(client(gateway, "leaver", timeout=1.0), "I will not wait")
    wait_for(lambda: flow_metric(gateway, "llm_sidecar_flow_abandoned_total") == abandoned + 1,
             timeout=10, what="extproc to see the client leave")
    assert total_depth(gateway) == 0
    for port in PODS:
        sim_state(port, {})
        wait_for(reads(gateway, "queue", port, 0), timeout=10,
                 what=f"extproc to read pod {port} with room")
    # Its concurrency slot (a cap of 1) is free, and its token bucket is as full as that of a
    # tenant who never sent anything: the same request leaves both the same remaining.
    left = ask(client(gateway, "leaver"), "now I wait")
    fresh = ask(client(gateway, "newcomer"), "now I wait")
    assert left.status_code == fresh.status_code == 200
    assert "x-llm-queued-ms" not in left.headers  # it did not wait
    assert left.headers["x-ratelimit-remaining"] == fresh.headers["x-ratelimit-remaining"]
    assert "I will not wait" not in contents(A) + contents(B)


# Two replicas: two gateways (Envoy + extproc each) in front of the same two pods, each pod
# running at most 2 sequences for real.

REAL_SLOTS = 2


@contextlib.contextmanager
def shared_pods(workdir: str) -> Iterator[list[int]]:
    ports = [free_port(), free_port()]
    children: list[Child] = []
    try:
        for i, port in enumerate(ports):
            children.append(start(f"sim {i}", sidecar_command(
                "sim", "--host", "127.0.0.1", "--port", str(port), "--name", f"pod{i}",
                "--max-model-len", "8192", "--max-num-seqs", str(REAL_SLOTS),
                "--decode-ms-per-token", "20", "--default-output-tokens", "10",
                "--natural-stop", "--no-dcgm")))
        for port, child in zip(ports, children, strict=True):
            wait_http_ok(f"http://{ip(port)}/health", 30, child)
        yield ports
    finally:
        for child in children:
            child.stop()


def replica_doc(ports: list[int], declared: int | None = None) -> dict[str, Any]:
    """One gateway of the pool ``ports``; its picker told the pods' ``max_num_seqs`` unless
    ``declared`` is None."""
    picker: dict[str, Any] = {"metrics_interval": "50ms", "stale_after": "1s",
                              "flow_control": {"max_wait": "20s"}}
    if declared is not None:
        picker["max_num_seqs"] = declared
    return {
        "version": 1,
        "envoy": {"listen": ip(free_port()), "admin": ip(free_port())},
        "services": {"extproc": ip(free_port()), "ratelimit": ip(free_port())},
        "clusters": {"pool": {
            "endpoints": [ip(p) for p in ports], "max_context": 8192,
            "endpoint_picker": picker}},
        "models": {"m": {"clusters": ["pool"], "default_max_tokens": 8}},
    }


def burst(gateways: list[Gateway], per_gateway: int, tag: str) -> list[int]:
    clients = [client(gw, timeout=60) for gw in gateways]
    with background() as pool:
        futures = [pool.submit(ask, c, f"{tag} {i} {uuid.uuid4()}")
                   for c in clients for i in range(per_gateway)]
        return [f.result(timeout=120).status_code for f in futures]


def peak_waiting(port: int) -> int:
    value: int = sim_state_view(port)["real"]["peak_waiting"]
    return value


def sim_state_view(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{ip(port)}/sim/state", timeout=5) as resp:
        view: dict[str, Any] = json.loads(resp.read())
    return view


def test_two_replicas_overfill_a_pod_by_at_most_one_request_each(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each replica queues its own requests and knows the other's only from the pods' metrics:
    the room a scrape shows is shared (each takes its part of it, at least one), so the pods'
    own queues stay within one request per other replica, where without flow control they
    take every request at once."""
    workdir = str(tmp_path_factory.mktemp("flow-replicas"))
    with shared_pods(workdir) as ports, \
            running_gateway(replica_doc(ports), f"{workdir}/one") as one, \
            running_gateway(replica_doc(ports), f"{workdir}/two") as two:
        # A first burst teaches each replica the pods' capacity (they start from a guess).
        assert set(burst([one, two], 6, "learn")) == {200}
        clear_journals(tuple(ports))  # and the peak
        statuses = burst([one, two], 8, "measured")
        peaks = [peak_waiting(port) for port in ports]
    assert statuses == [200] * 16  # every request answered, none lost or refused
    # One request each replica may add per scrape into room the other also saw, and one more
    # when a scrape lands between a completion and the pod's next admission.
    # Measured: 2 at most with flow control, 4 to 5 without it (the same bursts).
    assert max(peaks) <= 3, peaks



def test_a_fresh_gateway_told_the_pods_max_num_seqs_does_not_overfill_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Pods never seen full are taken at ``endpoint_picker.max_num_seqs``: a first burst of 12
    onto two fresh 2-sequence pods waits in extproc, and the pods' own queues stay empty. (Left
    to learn the capacity from a guess of 16, the same burst piles onto the pods: 4 waiting on
    each, in 3 runs out of 3.)"""
    workdir = str(tmp_path_factory.mktemp("flow-declared"))
    with shared_pods(workdir) as ports, \
            running_gateway(replica_doc(ports, REAL_SLOTS), f"{workdir}/gw") as gw:
        assert set(burst([gw], 12, "first")) == {200}
        peaks = [peak_waiting(port) for port in ports]
        served = [len(journal(port)) for port in ports]
    assert peaks == [0, 0], peaks
    assert sum(served) == 12, served
