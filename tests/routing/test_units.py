from __future__ import annotations

import pytest

from routing.units import join_hostport, parse_duration, parse_hostport, parse_rate


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("5m", 300), ("12h", 43200),
                                               ("7d", 604800)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "0s", "1w", "-1s", "1.5h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "amount", "window"), [
    ("10/s", 10, 1), ("600/min", 600, 60), ("100k/min", 100_000, 60), ("2M/min", 2_000_000, 60),
    ("100/h", 100, 3600), ("1k/d", 1000, 86400), ("50/5m", 50, 300), ("1.5k/s", 1500, 1),
])
def test_rates(text: str, amount: int, window: int) -> None:
    rate = parse_rate(text)
    assert (rate.amount, rate.window_s) == (amount, window)


@pytest.mark.parametrize("text", ["10", "10/q", "0/s", "-1/s", "10/0m", "1.5/s", "k/s"])
def test_bad_rates(text: str) -> None:
    with pytest.raises(ValueError, match="bad rate"):
        parse_rate(text)


def test_hostports() -> None:
    assert parse_hostport("10.0.0.1:8000") == ("10.0.0.1", 8000)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    for bad in ("host", "host:0", "host:99999", ":80"):
        with pytest.raises(ValueError, match="bad address"):
            parse_hostport(bad)


@pytest.mark.parametrize(("host", "port", "joined"), [
    ("10.0.0.1", 8000, "10.0.0.1:8000"), ("::1", 80, "[::1]:80"),
    ("fd00::7", 9901, "[fd00::7]:9901"), ("pod.ns.svc", 8000, "pod.ns.svc:8000")])
def test_a_joined_hostport_brackets_ipv6_and_parses_back(host: str, port: int, joined: str) -> None:
    assert join_hostport(host, port) == joined
    assert parse_hostport(joined) == (host, port)

