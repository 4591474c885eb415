"""Real-Redis fixtures for integration tests (see tests/harness/redis_fixtures.py)."""

from tests.harness.redis_fixtures import *  # noqa: F403
