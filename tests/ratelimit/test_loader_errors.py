"""One fixture file per way a descriptor config can be wrong, the exact message asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratelimit.errors import ConfigError
from ratelimit.loader import load_document, load_path

CONFIGS = Path(__file__).parent / "configs"
UNITS = " (expected second, minute, hour, day, week, month, year, or a window like 5m)"
LIMIT_KEYS = "unit, requests_per_unit, unlimited, name, replaces, burst, unit_multiplier, debt, concurrent"

CASES = {
    "unknown_key.yaml": f"7: unknown key 'burts' (expected one of: {LIMIT_KEYS})",
    "unknown_top_key.yaml": (
        "2: unknown key 'descriptor' (expected one of: domain, descriptors, on_backend_error)"
    ),
    "duplicate_descriptor.yaml": (
        "8: duplicate descriptor composite key 'llm.model_llama' (first at line 3)"
    ),
    "duplicate_nested_descriptor.yaml": (
        "8: duplicate descriptor composite key 'llm.kind_requests.api_key' (first at line 6)"
    ),
    "invalid_unit.yaml": f"5: invalid rate limit unit 'fortnight'{UNITS}",
    "invalid_short_unit.yaml": f"5: invalid rate limit unit '0m'{UNITS}",
    "missing_unit.yaml": "4: rate_limit needs unit (or unlimited: true)",
    "empty_domain.yaml": "1: config file cannot have empty domain",
    "missing_domain.yaml": "1: config file cannot have empty domain",
    "unlimited_with_unit.yaml": "6: unlimited rate limit should not specify 'unit'",
    "unlimited_with_requests_per_unit.yaml": (
        "6: unlimited rate limit should not specify 'requests_per_unit'"
    ),
    "syntax_error.yaml": "5: invalid YAML: expected ',' or '}', but got ':'",
    "duplicate_key.yaml": "4: duplicate key 'key' (first at line 3)",
    "empty_key.yaml": "3: descriptor has empty key",
    "missing_requests_per_unit.yaml": "4: rate_limit needs requests_per_unit (or unlimited: true)",
    "negative_requests_per_unit.yaml": ("6: requests_per_unit must be an integer from 0 to 4294967295"),
    "zero_burst.yaml": "7: burst must be a positive integer",
    "replaces_self.yaml": "9: replaces should not contain name of same descriptor",
    "replaces_empty.yaml": "8: should not have an empty replaces entry",
    "multiplier_with_short_unit.yaml": "6: unit_multiplier cannot be combined with unit '5m'",
    "bad_on_backend_error.yaml": "2: on_backend_error must be 'allow' or 'deny'",
    "bad_bool.yaml": "4: 'shadow_mode' must be true or false",
    "descriptors_not_a_list.yaml": "2: descriptors must be a list",
    "empty.yaml": "1: empty config: expected 'domain' and 'descriptors'",
}


def test_every_fixture_has_a_case() -> None:
    assert sorted(p.name for p in (CONFIGS / "bad").glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize(("name", "expected"), sorted(CASES.items()))
def test_config_error(name: str, expected: str) -> None:
    path = CONFIGS / "bad" / name
    with pytest.raises(ConfigError) as caught:
        load_path(path)
    assert str(caught.value) == f"{path}:{expected}"


def test_duplicate_domain_across_files_of_a_directory() -> None:
    folder = CONFIGS / "dup_domain"
    with pytest.raises(ConfigError) as caught:
        load_path(folder)
    assert str(caught.value) == (f"{folder}/b.yaml:3: duplicate domain 'llm' (first in {folder}/a.yaml:1)")


def test_missing_path() -> None:
    with pytest.raises(ConfigError) as caught:
        load_path(CONFIGS / "nope.yaml")
    assert str(caught.value) == f"{CONFIGS / 'nope.yaml'}:1: no such file or directory"


def test_document_errors_use_the_given_line_map() -> None:
    limit: dict[str, object] = {"unit": "x"}
    doc = {"domain": "llm", "descriptors": [{"key": "api_key", "rate_limit": limit}]}
    lines = {("descriptors", 0): 40, ("descriptors", 0, "rate_limit", "unit"): 42}
    with pytest.raises(ConfigError) as caught:
        load_document(doc, "routing.yaml", lines)
    assert str(caught.value) == f"routing.yaml:42: invalid rate limit unit 'x'{UNITS}"
    limit["unit"] = "second"
    with pytest.raises(ConfigError) as caught:
        load_document(doc, "routing.yaml", lines)
    assert str(caught.value).startswith("routing.yaml:40: rate_limit needs requests_per_unit")


def test_document_without_lines_points_at_line_one() -> None:
    with pytest.raises(ConfigError) as caught:
        load_document({"domain": ""}, "generated")
    assert str(caught.value) == "generated:1: config file cannot have empty domain"
