"""In CI a missing Redis or Envoy is a failure, not a skip (DEVELOPERS.md)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when running under CI (``CI=true``)."""
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(what: str) -> NoReturn:
    """Skip the test on a developer machine, fail it in CI."""
    if in_ci():
        pytest.fail(f"{what} is unavailable, and CI does not allow skipping it", pytrace=False)
    pytest.skip(f"{what} is unavailable")
