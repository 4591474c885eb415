"""Fixtures for the simulator tests: in-process simulators and HTTP clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from simulator import RunningSimulator, SimConfig, running_simulator

StartSim = Callable[..., Awaitable[RunningSimulator]]


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Start simulators named ``test-pool`` (overridable) that stop when the test ends.

    Decode is 0 ms unless a test asks for pacing, to keep the suite fast.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> RunningSimulator:
            settings: dict[str, Any] = {"name": "test-pool", "decode_ms_per_token": 0.0}
            settings.update(overrides)
            return await stack.enter_async_context(running_simulator(SimConfig(**settings)))

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP client for wire-level checks."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def sdk_for() -> AsyncIterator[Callable[[RunningSimulator], openai.AsyncOpenAI]]:
    """Build real ``openai`` SDK clients for a simulator; retries off so errors surface at once."""
    clients: list[openai.AsyncOpenAI] = []

    def make(sim: RunningSimulator) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
