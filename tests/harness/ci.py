"""In CI a missing Redis or Envoy is a failure, not a skip; the deploy tools are opt-in."""

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


DEPLOY_TOOLS_ENV = "LLM_SIDECAR_TEST_DEPLOY_TOOLS"
"""Set to 1 to also run the checks marked ``deploy_tools`` (``docker compose config``); a missing
tool then fails them. Unset, they are deselected: no CI machine has the compose plugin, and a
validator that needs none checks the same file on every run."""


def deploy_tools_wanted() -> bool:
    return os.environ.get(DEPLOY_TOOLS_ENV, "").lower() in {"1", "true", "yes"}
