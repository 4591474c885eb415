"""The URLs ``llm-sidecar up`` polls its own listeners at."""

from __future__ import annotations

import pytest

from llm_sidecar.up import local_url


@pytest.mark.parametrize(("host", "url"), [
    ("0.0.0.0", "http://127.0.0.1:9901/ready"), ("", "http://127.0.0.1:9901/ready"),
    ("::", "http://[::1]:9901/ready"), ("::1", "http://[::1]:9901/ready"),
    ("10.0.0.5", "http://10.0.0.5:9901/ready")])
def test_a_local_url_reaches_a_wildcard_listener_on_loopback_ipv6_in_brackets(
        host: str, url: str) -> None:
    """What ``up`` polls Envoy's admin, the simulators and the services' metrics at: an admin
    listener bound to ``::`` was polled at ``http://::1:9901/ready``, which no client reads."""
    assert local_url(host, 9901, "/ready") == url
