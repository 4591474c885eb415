"""Fixtures for ratelimit unit tests (the Redis ones are imported for the gRPC/reload tests)."""

from tests.harness.redis_fixtures import *  # noqa: F403
