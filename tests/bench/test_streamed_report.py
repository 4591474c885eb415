"""The rate a fixed load achieved, and the per-token CPU the report derives for streamed rows."""

from __future__ import annotations

import pytest

from bench import report
from bench.loadgen import Outcome
from bench.measure import Point
from bench.scenarios import Scenario, workloads


@pytest.mark.parametrize(("elapsed", "sent", "drain", "rps"), [
    # 240 streams of ~8 s sent in 20 s, the last answered within the 16 s drain: 12 req/s.
    (27.97, 20.0, 16.0, 12.0),
    # pyload sends on schedule whatever the gateway does: answers still coming 33 s after
    # the window are a gateway that did not keep up.
    (49.12, 20.0, 16.0, 240 / 33.12),
    # wrk runs a fixed time: all of its tail is drain, and overload shows as fewer requests.
    (36.0, 20.0, 36.0, 12.0),
    # Saturation: no window, the whole run.
    (20.0, None, 0.0, 12.0),
])
def test_achieved_rate_counts_only_the_drain_beyond_what_was_allowed(
        elapsed: float, sent: float | None, drain: float, rps: float) -> None:
    outcome = Outcome(240, 240, 0, elapsed, {}, sent, drain)
    assert outcome.rps == pytest.approx(rps)


def _point(scenario: str, cpu: dict[str, float]) -> Point:
    return Point(scenario, 0, 12, 192, 240, 240, 0, 28.0, 12.0, 8000.0, 8010.0, 8020.0, 8030.0,
                 8040.0, cpu_us_per_request=cpu)


def test_streamed_rows_get_cpu_per_token_and_the_ratio_to_bare_envoy() -> None:
    rows = [Scenario("bare/paced256", "bare", "paced256", None),
            Scenario("full-redis/paced256", "full-redis", "paced256", "bare/paced256"),
            Scenario("bare/chat", "bare", "chat", None)]
    points = [_point("bare/paced256", {"envoy": 12800.0}),
              _point("full-redis/paced256", {"envoy": 12800.0, "extproc": 2560.0,
                                             "ratelimit": 5120.0, "redis": 1280.0}),
              _point("bare/chat", {"envoy": 200.0})]
    doc = report.summarize(rows, workloads((12,)), points, {}, {}, {}, 1.0)
    cell = doc["scenarios"]["full-redis/paced256"]["rates"]["12"]
    assert cell["cpu_us_per_token"] == {"envoy": 50.0, "extproc": 10.0, "ratelimit": 20.0,
                                        "redis": 5.0}
    assert cell["cpu_us_total"] == 21760.0
    assert cell["cpu_vs_bare_envoy"] == 1.7
    assert "cpu_us_per_token" not in doc["scenarios"]["bare/chat"]["rates"]["12"]
    streamed = "\n".join(report._streamed(doc["scenarios"]))
    assert ("| full-redis/paced256 | 12.0 | 96 | 3,072 | 12800 / 50.00 | 2560 / 10.00 | "
            "5120 / 20.00 | - | 1280 / 5.00 | 21760 | 85.00 | 1.70 | 0 |") in streamed
    assert "bare/chat" not in streamed
