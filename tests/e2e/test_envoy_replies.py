"""Envoy's own replies (extproc down, no pool chosen, body too large) are OpenAI JSON too."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from routing.units import parse_hostport
from tests.harness.envoy_alone import envoy_only, post
from tests.harness.gateway import default_doc, envoy_counter
from tests.harness.waits import wait_for

BODY = b'{"model": "llama-2-13b", "messages": [{"role": "user", "content": "hi"}]}'


def test_extproc_down_fails_closed_with_503_json(tmp_path: Any) -> None:
    with envoy_only(default_doc(), str(tmp_path)) as url:
        status, content_type, payload = post(url, BODY)
    assert status == 503
    assert content_type == "application/json"
    assert payload["error"]["code"] == "upstream_unavailable"
    assert payload["error"]["type"] == "server_error"
    assert payload["error"]["param"] is None


def test_fail_open_without_a_pool_is_a_clear_503(tmp_path: Any) -> None:
    doc = default_doc()
    doc["services"]["failure_mode_allow"] = True
    with envoy_only(doc, str(tmp_path)) as url:
        status, content_type, payload = post(url, BODY)
    assert status == 503
    assert content_type == "application/json"
    assert payload["error"]["code"] == "upstream_unavailable"
    assert "No model pool" in payload["error"]["message"]


def test_a_body_above_the_limit_is_a_json_413(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_request_bytes"] = 4096
    # An extproc that accepts and never answers: Envoy buffers the body while it waits, so the
    # limit is hit first every time (with nothing listening, the connect error races the body).
    silent_extproc = parse_hostport(doc["services"]["extproc"])
    with socket.create_server(silent_extproc), envoy_only(doc, str(tmp_path)) as url:
        status, content_type, payload = post(url, b'{"model": "' + b"x" * 20000 + b'"}')
    assert status == 413
    assert content_type == "application/json"
    assert payload["error"]["code"] == "request_too_large"


def _ask(conn: socket.socket) -> bytes:
    """One keep-alive request on ``conn``; the bytes that came back (b"" if Envoy closed it)."""
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))
    try:
        return conn.recv(65536)
    except ConnectionResetError:
        return b""


def test_connections_past_max_connections_are_closed_and_admin_still_answers(tmp_path: Any) -> None:
    doc = default_doc()
    doc["envoy"]["max_connections"] = 3
    with envoy_only(doc, str(tmp_path)):
        address = parse_hostport(doc["envoy"]["listen"])
        held = [socket.create_connection(address, timeout=5) for _ in range(3)]
        try:
            for conn in held:  # each one served (extproc is down: a 503 JSON), then kept open
                assert _ask(conn).startswith(b"HTTP/1.1 503")
            with socket.create_connection(address, timeout=5) as extra:
                assert _ask(extra) == b""
            admin_url = f"http://{doc['envoy']['admin']}"  # outside the cap: it answers
            # Envoy closes the refused socket before its worker counts the refusal: a busy
            # machine can show the close first (CI did once), so wait for the count.
            wait_for(lambda: envoy_counter(admin_url, "downstream_global_cx_overflow") >= 1,
                     timeout=10, what="Envoy to count the refused connection")
            held.pop().close()
            deadline = time.monotonic() + 5
            while True:  # the freed slot is counted back within a moment
                with socket.create_connection(address, timeout=5) as again:
                    answer = _ask(again)
                if answer or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert answer.startswith(b"HTTP/1.1 503")
        finally:
            for conn in held:
                conn.close()


def _raw(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is; the status line's code, headers and body of the answer."""
    host, port = parse_hostport(url.removeprefix("http://"))
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if sep and length is not None and len(rest) >= length:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(("request_bytes", "status"), [
    # a header block above Envoy's limit
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n",
     431),
    # a transfer coding Envoy does not implement
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
     501),
    # HTTP/1.0
    (b"POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", 426),
    # content-length and chunked at once (a smuggling shape)
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
     b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400),
])
def test_envoys_own_protocol_errors_are_openai_json(tmp_path: Any, request_bytes: bytes,
                                                     status: int) -> None:
    with envoy_only(default_doc(), str(tmp_path)) as url:
        code, headers, body = _raw(url, request_bytes)
    assert code == status
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["code"] and error["code"] in error["message"]  # Envoy's details, named
