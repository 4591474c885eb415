"""Parsing of the YAML's durations (``30s``, ``7d``) and rates (``10/s``, ``100k/min``, ``5/5m``).

Pure functions; a bad value raises ``ValueError`` with a message an operator can act on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sidecar_runtime.wire.names import UNIX_PREFIX

_UNIT_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
DURATION_PATTERN = r"^(\d+)(s|m|h|d)$"
RATE_PATTERN = r"^(\d+(?:\.\d+)?)([kM]?)/(\d*)(s|min|m|h|d)$"
HOSTPORT_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):[0-9]{1,5}$"
"""The shapes of the values above, for the JSON Schema (editors); the parsers decide."""
INTERVAL_PATTERN = r"^(\d+)(ms|s|m|h)$"
_DURATION = re.compile(DURATION_PATTERN)
_INTERVAL = re.compile(INTERVAL_PATTERN)
_RATE = re.compile(RATE_PATTERN)
_SUFFIX = {"": 1, "k": 1_000, "M": 1_000_000}


def parse_duration(text: str) -> int:
    """Seconds in a duration such as ``30s``, ``5m``, ``12h`` or ``7d``."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"bad duration {text!r}: use a whole number with s, m, h or d, like 30s or 7d")
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds <= 0:
        raise ValueError(f"bad duration {text!r}: must be more than zero")
    return seconds


def parse_interval(text: str) -> float:
    """Seconds (a float) in a short interval such as ``100ms``, ``2s`` or ``5m``."""
    raw = str(text).strip()
    match = _INTERVAL.match(raw)
    if not match:
        raise ValueError(f"bad interval {raw!r}: use a whole number with ms, s, m or h, "
                         "like 100ms or 5s")
    number, unit = int(match.group(1)), match.group(2)
    seconds = number / 1000 if unit == "ms" else float(number * _UNIT_SECONDS[unit])
    if seconds <= 0:
        raise ValueError(f"bad interval {raw!r}: must be more than zero")
    return seconds


@dataclass(frozen=True)
class Rate:
    """``amount`` per ``window_s`` seconds, as written (``100k/min`` is 100000 per 60 s)."""

    amount: int
    window_s: int
    text: str

    @property
    def per_second(self) -> float:
        return self.amount / self.window_s


MAX_AMOUNT = 1e15
"""Largest amount a rate may name (a billion tokens per second is still far below it)."""


def parse_rate(text: str) -> Rate:
    """A rate such as ``10/s``, ``600/min``, ``2M/min``, ``100/h``, ``1k/d`` or ``50/5m``."""
    raw = str(text).strip()
    match = _RATE.match(raw)
    if not match:
        raise ValueError(
            f"bad rate {raw!r}: use N/s, N/min, N/h, N/d or N/5m-style windows, "
            "with an optional k or M suffix, like 100k/min"
        )
    number, suffix, count, unit = match.groups()
    amount = float(number) * _SUFFIX[suffix]
    if not amount < MAX_AMOUNT:  # also inf, from a number of hundreds of digits
        raise ValueError(f"bad rate {raw[:40]!r}: the amount must be below {MAX_AMOUNT:.0e}")
    if amount != int(amount) or amount <= 0:
        raise ValueError(f"bad rate {raw!r}: the amount must be a whole number above zero")
    window = (int(count) if count else 1) * _UNIT_SECONDS[unit]
    if window <= 0:
        raise ValueError(f"bad rate {raw!r}: the window must be more than zero")
    return Rate(amount=int(amount), window_s=window, text=raw)


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:80``) split into host and port."""
    raw = text.strip()
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad address {raw!r}: use host:port, like 10.0.0.11:8000")
    return host.strip("[]"), int(port)


def join_hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``[::1]:80``, as URLs and Envoy write it):
    what :func:`parse_hostport` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_service_address(text: str) -> tuple[str, int]:
    """A gRPC service address: ``host:port``, or ``unix:/absolute/path`` (a Unix socket,
    returned as ``("unix:/absolute/path", 0)``)."""
    raw = text.strip()
    if raw.startswith(UNIX_PREFIX):
        if not raw[len(UNIX_PREFIX):].startswith("/"):
            raise ValueError(f"bad address {raw!r}: a Unix socket is unix:/absolute/path")
        return raw, 0
    return parse_hostport(raw)
