"""What bounds Envoy's memory, through the real Envoy: the heap monitor refuses new requests
above its limit (as OpenAI JSON) and serves below it, and an HTTP/2 client gets the stream cap
and flow-control windows render sets, and cannot open a stream past the cap."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from hyperframe.frame import HeadersFrame, SettingsFrame

from routing.render.bounds import HTTP2_CONNECTION_WINDOW
from routing.units import parse_hostport
from tests.harness.envoy_alone import envoy_only, post
from tests.harness.gateway import default_doc, envoy_counter, running_gateway
from tests.harness.h2_frames import raw_h2
from tests.harness.h2c import h2_request, h2_streams_until_reset

BODY = b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}]}'
STOP = "overload.envoy.overload_actions.stop_accepting_requests.active$"
PRESSURE = "overload.envoy.resource_monitors.fixed_heap.pressure$"
H2_INITIAL_WINDOW = 65_535


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds; the timeout only ends a test that would hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def admin_url(doc: dict[str, Any]) -> str:
    return f"http://{doc['envoy']['admin']}"


def test_a_heap_above_max_heap_bytes_refuses_new_requests_with_json_503(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_heap_bytes"] = 1024 * 1024  # Envoy alone uses several MiB
    with envoy_only(doc, str(tmp_path)) as url:
        admin = admin_url(doc)
        wait_for("stop_accepting_requests active",
                 lambda: envoy_counter(admin, STOP) == 1)
        assert envoy_counter(admin, PRESSURE) > 100  # percent of max_heap_bytes
        status, content_type, payload = post(url, BODY)
        # the probe path is refused too: the Service stops sending to an overloaded pod
        health = urllib_status(f"{url}/healthz")
    assert status == 503
    assert content_type == "application/json"
    assert payload["error"] == {"message": "The gateway is overloaded; retry later.",
                                "type": "server_error", "param": None,
                                "code": "server_overloaded"}
    assert health == 503


def test_a_heap_below_max_heap_bytes_is_watched_and_requests_go_on(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_heap_bytes"] = 256 * 1024 * 1024
    with envoy_only(doc, str(tmp_path)) as url:
        admin = admin_url(doc)
        wait_for("the heap monitor reports", lambda: envoy_counter(admin, PRESSURE) > 0)
        status, _, payload = post(url, BODY)
        assert envoy_counter(admin, PRESSURE) < 90
        assert envoy_counter(admin, STOP) == 0
    # past the overload manager: extproc (not running here) is what answers, failing closed
    assert (status, payload["error"]["code"]) == (503, "upstream_unavailable")


def test_no_heap_monitor_without_max_heap_bytes(tmp_path: Any) -> None:
    doc = default_doc()
    with envoy_only(doc, str(tmp_path)):
        # the connection monitor is always there, so the overload manager is running
        wait_for("the connection monitor reports", lambda: envoy_counter(
            admin_url(doc), "global_downstream_max_connections.failed_updates$") == 0)
        with_heap = envoy_counter(admin_url(doc), "fixed_heap")
    assert with_heap == 0


def urllib_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def chat_headers(listen: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
            (":authority", listen), ("content-type", "application/json")]


def test_h2_clients_get_the_stream_cap_and_bounded_windows(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_concurrent_streams"] = 7
    with envoy_only(doc, str(tmp_path)), raw_h2(doc["envoy"]["listen"]) as conn:
        settings = conn.server_settings
        while conn.connection_window_increments == 0:
            conn.read_frame()
    assert settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 7
    assert settings[SettingsFrame.INITIAL_WINDOW_SIZE] == 8 * 1024 * 1024  # max_request_bytes
    assert H2_INITIAL_WINDOW + conn.connection_window_increments == HTTP2_CONNECTION_WINDOW


def test_a_client_ignoring_the_stream_cap_loses_its_connection(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_concurrent_streams"] = 2
    doc["services"]["extproc_timeout_s"] = 60  # the open streams wait on extproc meanwhile
    # An extproc that accepts and never answers: every stream stays open, waiting for it.
    silent_extproc = parse_hostport(doc["services"]["extproc"])
    listen = doc["envoy"]["listen"]
    with socket.create_server(silent_extproc), envoy_only(doc, str(tmp_path)), \
            raw_h2(listen) as conn:
        for stream_id in (1, 3, 5):  # h2 (the library) would refuse to send the third
            conn.open_stream(stream_id, chat_headers(listen))
        # Envoy (nghttp2) takes a stream past the acknowledged cap as a connection error:
        # it closes the connection, and the two streams on it go with it.
        frames = conn.read_until_closed()
        admin = admin_url(doc)
        protocol_errors = envoy_counter(admin, "http.llm.downstream_cx_protocol_error$")
        requests = envoy_counter(admin, "http.llm.downstream_rq_total$")
    assert not [f for f in frames if isinstance(f, HeadersFrame)], frames  # nothing answered
    assert protocol_errors == 1
    assert requests == 2  # the third stream never became a request


def chat(content_bytes: int) -> bytes:
    return json.dumps({"model": "llama-2-13b", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "x" * content_bytes}]}).encode()


def test_http2_streams_cannot_get_around_the_body_limit(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_request_bytes"] = 64 * 1024
    with running_gateway(doc, str(tmp_path)) as gw:
        listen = gw.url.removeprefix("http://")
        # in 16 KiB frames, as flow control lets them go: each HTTP/2 stream's buffer limit is
        # its window, so without a window of max_request_bytes (Envoy's default is 256 MiB)
        # this body reached extproc and the pool
        too_big = h2_request(listen, chat_headers(listen), body=chat(200_000))
        served_after_too_big = sum(len(gw.sim_requests(name)) for name in gw.sims)
        fits = h2_request(listen, chat_headers(listen), body=chat(60_000))
    assert too_big.status == 413
    assert json.loads(too_big.body)["error"]["code"] == "request_too_large"
    assert served_after_too_big == 0
    assert fits.status == 200, fits.body


def test_near_max_heap_bytes_the_streams_holding_big_bodies_are_reset(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_heap_bytes"] = 40 * 1024 * 1024  # Envoy alone: ~20% of it
    doc["services"]["extproc_timeout_s"] = 60  # bodies pile up while extproc never answers
    silent_extproc = parse_hostport(doc["services"]["extproc"])
    listen = doc["envoy"]["listen"]
    with socket.create_server(silent_extproc), envoy_only(doc, str(tmp_path)) as url:
        admin = admin_url(doc)
        wait_for("the heap monitor reports", lambda: envoy_counter(admin, PRESSURE) > 0)
        # 6 streams of 7 MiB each (under the 8 MiB body limit): 42 MiB, past the heap limit
        resets = h2_streams_until_reset(listen, chat_headers(listen), [7 * 1024 * 1024] * 6)
        reset_count = envoy_counter(admin, "envoy.overload_actions.reset_high_memory_stream.count$")
        # the memory is back: Envoy accepts requests again
        wait_for("requests accepted again", lambda: envoy_counter(admin, STOP) == 0)
        health = urllib_status(f"{url}/healthz")
    assert len(resets) == 6 and reset_count >= 1
    assert set(resets.values()) == {2}  # INTERNAL_ERROR
    assert health == 200
