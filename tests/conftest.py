"""Fixtures shared by every test folder live in tests/harness; this file only registers them."""

pytest_plugins: list[str] = ["tests.harness.redis_fixtures"]
