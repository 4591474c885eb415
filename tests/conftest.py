"""Fixtures shared by every test folder live in tests/harness; this file registers them and
marks the slow tiers, so ``pytest -m "not e2e and not fuzz" -n 4`` is the fast edit loop."""

from __future__ import annotations

import os
from pathlib import Path

# Before anything imports grpc: tests start processes (subprocess with a preexec_fn, which runs
# Python's at-fork handlers in the child) while grpc.aio channels of earlier tests keep gRPC's
# threads busy. gRPC's fork handlers then ran in the child ("Other threads are currently
# calling into gRPC, skipping fork() handlers") and the child could abort before its exec (a
# worker supervisor exited -6 in one CI run). No test forks a process that keeps using gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from tests.harness.ci import deploy_tools_wanted

pytest_plugins: list[str] = ["tests.harness.redis_fixtures"]

_TESTS = Path(__file__).resolve().parent
_TIERS = {"e2e": "e2e", "chaos": "e2e", "bench": "e2e", "fuzz": "fuzz"}
"""Top-level test folder → the marker its every test carries (real Envoy, or long fuzzing)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not deploy_tools_wanted():
        # Deselected, so the summary counts them, rather than skipped in every run.
        deselected = [item for item in items if item.get_closest_marker("deploy_tools")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        marker = _TIERS.get(folder)
        if marker is not None:
            item.add_marker(marker)
