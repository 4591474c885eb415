"""A Limiter remembers what each descriptor matched (:class:`ratelimit.limiter.Matches`): a
plan from remembered matches is the plan matching afresh gives, a reload is matched afresh,
and what is remembered stays bounded whatever values clients send."""

from __future__ import annotations

import pytest

from ratelimit.limiter import DescriptorRequest, LimitRequest, Matches, Override, plan
from ratelimit.loader import load_text

CONFIG = """
domain: d
descriptors:
  - key: kind
    value: requests
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
      - key: tenant
        value: vip
        rate_limit: {unlimited: true}
      - key: model
        value: m*
        rate_limit: {unit: minute, requests_per_unit: 6, name: model_limit}
  - key: kind
    value: tokens
    descriptors:
      - key: tenant
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 600}
      - key: api_key
        rate_limit: {unit: minute, requests_per_unit: 600, debt: true}
  - key: kind
    value: concurrent
    descriptors:
      - key: tenant
        rate_limit: {concurrent: 4}
  - key: override
    value: model
    rate_limit:
      replaces: [{name: model_limit}]
      unit: second
      requests_per_unit: 100
"""
LEASE = "lease-0123456789"
REQUESTS = {
    "requests, default and exact": ((("kind", "requests"), ("tenant", "a")),
                                    (("kind", "requests"), ("tenant", "vip"))),
    "wildcard and a descriptor that replaces it": ((("kind", "requests"), ("model", "m1")),
                                                   (("override", "model"),)),
    "wildcard alone": ((("kind", "requests"), ("model", "m1")),),
    "not limited": ((("kind", "requests"), ("color", "blue")), (("other", "x"),)),
}


def _request(*descriptors: tuple[tuple[str, str], ...], hits: int | None = None,
             lease: str | None = None, phase: str = "admit", used: int | None = None) -> LimitRequest:
    return LimitRequest("d", tuple(DescriptorRequest(entries, hits, None, lease, phase, used)  # type: ignore[arg-type]
                                   for entries in descriptors))


CASES = [
    *(_request(*descriptors) for descriptors in REQUESTS.values()),
    _request((("kind", "tokens"), ("tenant", "a")), (("kind", "tokens"), ("api_key", "k")),
             hits=120, lease=LEASE),
    _request((("kind", "tokens"), ("tenant", "a")), lease=LEASE, phase="settle", used=80),
    _request((("kind", "concurrent"), ("tenant", "a")), lease=LEASE),
    _request((("kind", "concurrent"), ("tenant", "a")), lease=LEASE, phase="release"),
    _request((("kind", "concurrent"), ("tenant", "a"))),  # no lease: cap not applied
    LimitRequest("d", (DescriptorRequest((("kind", "requests"), ("tenant", "a")), None,
                                         Override(3, "minute")),)),
    LimitRequest("nope", (DescriptorRequest((("kind", "requests"),)),)),
]


@pytest.mark.parametrize("request_", CASES)
def test_a_remembered_match_plans_what_matching_afresh_does(request_: LimitRequest) -> None:
    config = load_text(CONFIG, "d.yaml")
    matches = Matches()
    fresh = plan(config, request_)
    assert plan(config, request_, matches) == fresh  # matched, then remembered
    assert plan(config, request_, matches) == fresh  # from memory


def test_the_tables_cover_every_outcome() -> None:
    """The cases above hit, skip, settle, release and replace: the comparison means something."""
    config = load_text(CONFIG, "d.yaml")
    plans = [plan(config, case) for case in CASES]
    items = [item for p in plans for item in p.items]
    assert any(item.hit is not None and item.hit.lease for item in items)
    assert any(item.settle is not None and item.settle.used is None for item in items)
    assert any(item.settle is not None and item.settle.used == 80 for item in items)
    assert any(item.limit is not None and item.limit.unlimited for item in items)
    replaced = plans[1].items[0]
    assert replaced.limit is None and replaced.hit is None


def test_a_reload_is_matched_afresh() -> None:
    before = load_text(CONFIG, "d.yaml")
    after = load_text(CONFIG.replace("requests_per_unit: 10, burst: 20",
                                     "requests_per_unit: 1, burst: 2"), "d.yaml")
    request = _request((("kind", "requests"), ("tenant", "a")))
    matches = Matches()
    first = plan(before, request, matches).items[0]
    second = plan(after, request, matches).items[0]
    assert first.hit is not None and first.hit.spec.capacity == 20
    assert second.hit is not None and second.hit.spec.capacity == 2


def test_what_is_remembered_stays_bounded() -> None:
    """A client varying its tenant on every request cannot grow the memory past the bound,
    and an entry too long to be worth keeping is matched, never kept."""
    config = load_text(CONFIG, "d.yaml")
    domain = config.domain("d")
    assert domain is not None
    matches = Matches(limit=8)
    for n in range(100):
        matches.get(domain, (("kind", "requests"), ("tenant", f"t{n}")))
        assert len(matches) <= 8
    long = (("kind", "requests"), ("tenant", "x" * 600))
    assert matches.get(domain, long).key is not None
    assert long not in matches


def test_two_domains_are_remembered_side_by_side() -> None:
    """A descriptor file with several domains: each keeps its own matches, and the same entries
    in another domain are that domain's (no thrash, no mix-up)."""
    other = CONFIG.replace("domain: d", "domain: e").replace("requests_per_unit: 10, burst: 20",
                                                             "requests_per_unit: 1, burst: 3")
    config = load_text(CONFIG, "d.yaml")
    second = load_text(other, "e.yaml")
    d, e = config.domain("d"), second.domain("e")
    assert d is not None and e is not None
    matches = Matches()
    entries = (("kind", "requests"), ("tenant", "a"))
    for _ in range(2):
        first, then = matches.get(d, entries), matches.get(e, entries)
        assert first.spec is not None and first.spec.capacity == 20
        assert then.spec is not None and then.spec.capacity == 3
        assert first.key != then.key
    assert len(matches) == 2
