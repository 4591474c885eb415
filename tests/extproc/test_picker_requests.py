"""A request to an ``endpoint_picker`` pool, through the stream state with the real picker: the
pods it names, the 503 a low-priority request gets from a saturated pool, the open count it
gives back when the stream ends, and the headers a client cannot use to pick."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from extproc.actions import Continue, Reply
from extproc.picker.pick import EndpointPicker
from extproc.picker.state import EJECT_AFTER, PodMetrics
from extproc.stream import StreamState
from tests.extproc.helpers import BASE, JSON_POST, Unqueued, snapshot

SECRET = b"test-secret"
PODS = ["10.0.0.21:8000", "10.0.0.22:8000", "10.0.0.23:8000"]
NOW = 100.0


def picker_snapshot() -> Any:
    clusters = {**BASE["clusters"], "vllm-short": {
        "endpoints": PODS, "max_context": 2048, "endpoint_picker": {}}}
    return snapshot(clusters=clusters, priority={"high_below": 1, "low_from": 100})


def picker_with(waiting: dict[str, float]) -> EndpointPicker:
    snap = picker_snapshot()
    picker = EndpointPicker(snap.config, clock=lambda: NOW, rng=random.Random(7))
    pool = picker.pools["vllm-short"]
    for pod in PODS:
        pool.record_scrape(pod, PodMetrics(waiting=waiting.get(pod, 0.0)), NOW)
    return picker


def send(picker: EndpointPicker, *, max_tokens: int = 4, extra: dict[str, str] | None = None
         ) -> tuple[StreamState, Continue | Reply]:
    state = StreamState(picker_snapshot(), SECRET, picker=Unqueued(picker))
    headers = {":path": "/v1/chat/completions", **JSON_POST, "x-request-id": "r1",
               **(extra or {})}
    first = state.handle("request_headers", headers, b"", False)
    assert isinstance(first, Continue)
    body = {"model": "llama-2-13b", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there " * 20}]}
    action = state.handle("request_body", None, orjson.dumps(body), True)
    assert isinstance(action, Continue | Reply)
    return state, action


def test_the_request_names_the_free_pod_first_then_the_runners_up() -> None:
    picker = picker_with({PODS[0]: 40, PODS[1]: 20})
    _, action = send(picker)
    assert isinstance(action, Continue)
    assert action.lb_endpoints == (PODS[2], PODS[1], PODS[0])


def test_the_open_count_is_given_back_when_the_stream_ends() -> None:
    picker = picker_with({})
    pool = picker.pools["vllm-short"]
    state, action = send(picker)
    assert isinstance(action, Continue)
    picked = pool.pods[action.lb_endpoints[0]]
    assert picked.in_flight == 1 and picked.sent_since_scrape == 1
    state.close()
    state.close()  # closing twice gives back once
    assert picked.in_flight == 0 and picked.sent_since_scrape == 1


def test_a_low_priority_request_to_a_saturated_pool_gets_503_with_retry_after() -> None:
    picker = picker_with({pod: 40 for pod in PODS})
    _, action = send(picker, max_tokens=1500)  # weight far above low_from
    assert isinstance(action, Reply)
    assert action.status == 503
    assert ("retry-after", "1") in action.headers
    error = orjson.loads(action.body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
    assert all(pod.in_flight == 0 for pod in picker.pools["vllm-short"].pods.values())
    _, high = send(picker, max_tokens=1)  # a tiny request is high priority: still served
    assert isinstance(high, Continue) and high.lb_endpoints


def test_a_pool_without_a_picker_names_no_pod() -> None:
    picker = picker_with({})
    state = StreamState(picker_snapshot(), SECRET, picker=Unqueued(picker))
    state.handle("request_headers", {":path": "/v1/chat/completions", **JSON_POST}, b"",
                 False)
    body = {"model": "llama-2-13b", "max_tokens": 4000,  # only vllm-long fits
            "messages": [{"role": "user", "content": "hi"}]}
    action = state.handle("request_body", None, orjson.dumps(body), True)
    assert isinstance(action, Continue) and action.lb_endpoints == ()
    assert ("x-llm-cluster", "vllm-long") in action.set_headers


def test_a_client_header_naming_a_pod_is_removed_and_steers_nothing() -> None:
    picker = picker_with({PODS[0]: 40})
    spoof = {"x-gateway-destination-endpoint": PODS[0],
             "x-gateway-destination-endpoint-subset": PODS[0]}
    state = StreamState(picker_snapshot(), SECRET, picker=Unqueued(picker))
    first = state.handle("request_headers", {":path": "/v1/chat/completions",
                                             **JSON_POST, **spoof}, b"", False)
    assert isinstance(first, Continue)
    assert set(spoof) <= set(first.remove_headers)
    _, action = send(picker, extra=spoof)
    assert isinstance(action, Continue) and action.lb_endpoints[0] != PODS[0]


FROM_POD = {"x-envoy-upstream-service-time": "3", "content-type": "application/json"}
"""What Envoy's router adds to every answer an upstream sent (never to a local reply)."""


@pytest.mark.parametrize(("answer", "ejects"), [
    ({":status": "500", **FROM_POD}, True),
    ({":status": "503", **FROM_POD}, True),
    ({":status": "200", **FROM_POD, "content-type": "text/event-stream"}, False),
    ({":status": "400", **FROM_POD}, False),  # the client's fault
    # Envoy's local replies say nothing of the pod: the rate limiter's 503 when its service
    # fails or its store is down, a circuit breaker's 503, an idle timeout's 504.
    ({":status": "503", "content-type": "application/json"}, False),
    ({":status": "503", "x-llm-ratelimit-backend": "redis"}, False),
    ({":status": "503", "x-envoy-overloaded": "true"}, False),
    ({":status": "504", "content-type": "application/json"}, False),
])
def test_the_picked_pods_answers_decide_its_ejection(answer: dict[str, str], ejects: bool) -> None:
    """Five picked requests in a row answered with a 5xx take the pod out of the picks."""
    picker = picker_with({PODS[0]: 40, PODS[1]: 20})  # the free pod is picked first
    for _ in range(EJECT_AFTER):
        state, action = send(picker)
        assert isinstance(action, Continue) and action.lb_endpoints[0] == PODS[2]
        state.handle("response_headers", answer, b"", True)
        state.close()
    _, action = send(picker)
    assert isinstance(action, Continue)
    assert (action.lb_endpoints[0] != PODS[2]) is ejects
    assert picker.pools["vllm-short"].pods[PODS[2]].ejections_total == int(ejects)
