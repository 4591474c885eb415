"""The configuration examples of envoyproxy/ratelimit's README load unchanged and decide as
that README documents (token buckets here: "N per unit" admits a burst of N at once)."""

from __future__ import annotations

from ratelimit.limiter import UNLIMITED_REMAINING
from ratelimit.loader import load_text

from .helpers import Decider

EXAMPLE_1 = """
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
"""

EXAMPLE_2 = """
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
"""

EXAMPLE_3 = """
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
"""

EXAMPLE_4_FLAT = """
domain: example4
descriptors:
  - key: key
    value: value
    rate_limit:
      requests_per_unit: 300
      unit: second
"""

EXAMPLE_4_NESTED = """
domain: example4
descriptors:
  - key: key
    value: value
    descriptors:
      - key: subkey
        rate_limit:
          requests_per_unit: 300
          unit: second
"""

EXAMPLE_5 = """
domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true

  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
"""

EXAMPLE_6 = """
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
"""

EXAMPLE_7 = """
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
"""

EXAMPLE_8 = """
domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: key1
    value: value1
    rate_limit:
      unit: minute
      requests_per_unit: 20
"""

EXAMPLE_9 = """
domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
"""


async def test_example_1_key_value_limits() -> None:
    d = Decider(load_text(EXAMPLE_1, "example1.yaml"))
    assert await d.admitted("mongo_cps", [("database", "users")], times=501) == 500
    assert await d.admitted("mongo_cps", [("database", "default")], times=501) == 500
    # No rule for other values: not limited.
    assert await d.admitted("mongo_cps", [("database", "orders")], times=600) == 600


async def test_example_2_nested_and_multiple_descriptors() -> None:
    d = Decider(load_text(EXAMPLE_2, "example2.yaml"))
    marketing = [("message_type", "marketing"), ("to_number", "2061111111")]
    number = [("to_number", "2061111111")]
    for _ in range(5):
        assert (await d.check("messaging", marketing, number)).ok
    outcome = await d.check("messaging", marketing, number)
    assert not outcome.ok
    assert [s.code for s in outcome.statuses] == ["over_limit", "ok"]
    # Another number gets its own 5 per day; plain messages to the first number go on to 100.
    assert await d.admitted("messaging", [marketing[0], ("to_number", "2062222222")], times=6) == 5
    assert await d.admitted("messaging", number, times=100) == 95


async def test_example_3_most_specific_match_wins() -> None:
    d = Decider(load_text(EXAMPLE_3, "example3.yaml"))
    assert await d.admitted("edge_proxy_per_ip", [("remote_address", "50.0.0.1")], times=11) == 10
    assert await d.admitted("edge_proxy_per_ip", [("remote_address", "50.0.0.5")], times=3) == 0


async def test_example_4_depth_must_match() -> None:
    request = [("key", "value"), ("subkey", "subvalue")]
    flat = Decider(load_text(EXAMPLE_4_FLAT, "example4.yaml"))
    assert await flat.admitted("example4", request, times=400) == 400
    nested = Decider(load_text(EXAMPLE_4_NESTED, "example4.yaml"))
    assert await nested.admitted("example4", request, times=301) == 300


async def test_example_5_unlimited() -> None:
    d = Decider(load_text(EXAMPLE_5, "example5.yaml"))
    outcome = await d.check("internal", [("ldap", "x")])
    assert outcome.ok
    assert outcome.statuses[0].remaining == UNLIMITED_REMAINING
    assert len(d.store) == 0  # never reaches the store
    assert await d.admitted("internal", [("azure", "x")], times=101) == 100


async def test_example_6_shadow_mode() -> None:
    d = Decider(load_text(EXAMPLE_6, "example6.yaml"))
    user_a = [("service", "auth-service"), ("user", "user-a")]
    user_b = [("service", "auth-service"), ("user", "user-b")]
    assert await d.admitted("example6", user_a, times=50) == 50
    shadowed = d.metrics.decisions.labels("other", "requests", "shadow_over_limit")._value.get()
    assert shadowed == 40
    assert await d.admitted("example6", user_b, times=21) == 20


async def test_example_7_replaces() -> None:
    d = Decider(load_text(EXAMPLE_7, "example7.yaml"))
    first = [("key_1", "value_1"), ("user", "bkthomps")]
    second = [("key_2", "value_2"), ("user", "bkthomps")]
    # Both descriptors: only the replacing 10/s limit applies.
    for _ in range(10):
        outcome = await d.check("example7", first, second)
        assert outcome.ok
        assert outcome.statuses[0].limit is None
    assert not (await d.check("example7", first, second)).ok
    # ... and the replaced 5/s limit was not touched.
    assert await d.admitted("example7", first, times=6) == 5


async def test_example_8_detailed_metric() -> None:
    config = load_text(EXAMPLE_8, "example8.yaml")
    limit = config.domains["example8"].match([("key1", "unspecified_value")])
    assert limit is not None and limit.detailed_metric and limit.requests_per_unit == 10
    d = Decider(config)
    assert await d.admitted("example8", [("key1", "unspecified_value")], times=11) == 10
    assert await d.admitted("example8", [("key1", "value1")], times=21) == 20


async def test_example_9_wildcard() -> None:
    d = Decider(load_text(EXAMPLE_9, "example9.yaml"))
    assert await d.admitted("example9", [("key1", "value_1")], times=21) == 20
    assert await d.admitted("example9", [("key1", "value_2")], times=21) == 20
    assert await d.admitted("example9", [("key1", "other")], times=30) == 30
