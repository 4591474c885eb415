"""What a request cost its token bucket, read through the gateway as a client sees it.

Shared by the end-to-end tests of settlement (Envoy's usage filters, extproc's batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.chaos.support import wait_until
from tests.harness.openai_types import usage_of, user

MESSAGES = user("hi")
Probe = Callable[..., Any]
"""``client.chat.completions.with_raw_response.create`` of the tenant whose bucket is read."""


def remaining(response: Any) -> int:
    return int(response.headers["x-ratelimit-remaining-tokens"])


def charged_by(probe: Probe, settled: Callable[[], float], send: Callable[[], int],
               day_cap: int) -> tuple[int, int, int]:
    """(tokens the bucket lost to ``send``'s request once settled, the usage ``send`` returned,
    the tokens that may have refilled meanwhile, with ``day_cap`` tokens a day).

    A probe before and after reads the bucket (``x-ratelimit-remaining-tokens``, after each
    probe's own equal reservation); ``settled()`` counts the service's settlements, so the
    first probe's and the request's settles are waited for, and the first probe's usage taken
    out."""
    started = time.monotonic()
    settles = settled()
    first = probe(model="llama-2-13b", messages=MESSAGES, max_tokens=1)
    probe_usage = usage_of(first.parse()).total_tokens
    wait_until(lambda: settled() >= settles + 1, 10, 0.05)
    total = send()
    wait_until(lambda: settled() >= settles + 2, 10, 0.05)
    second = probe(model="llama-2-13b", messages=MESSAGES, max_tokens=1)
    refill = int((time.monotonic() - started) * day_cap / 86400) + 1
    return remaining(first) - remaining(second) - probe_usage, total, refill
