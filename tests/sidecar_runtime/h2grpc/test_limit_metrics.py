"""What an operator sees of the server's limits: ``llm_sidecar_grpc_connections_closed_total`` by
reason, ``llm_sidecar_grpc_connections``, and ``LLM_SIDECAR_GRPC_MAX_CONNECTIONS``."""

from __future__ import annotations

import asyncio

import pytest
from hyperframe.frame import PingFrame
from prometheus_client import CollectorRegistry

from sidecar_runtime.h2grpc import frames as f
from sidecar_runtime.process.service_process import grpc_server
from sidecar_runtime.process.settings import Settings
from tests.harness.waits import until
from tests.sidecar_runtime.h2grpc.clients import FrameClient, goaway


def _closed(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("llm_sidecar_grpc_connections_closed_total",
                                      {"service": "svc", "reason": reason})
    return value or 0.0


async def test_closes_are_counted_by_reason_and_the_cap_comes_from_the_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_SIDECAR_GRPC_MAX_CONNECTIONS", "2")
    registry = CollectorRegistry()
    server = grpc_server("svc", 1024, Settings(), registry)
    assert server.limits.max_connections == 2
    port = await server.add_port("127.0.0.1:0")
    await server.start()
    try:
        flooder = await FrameClient.open(port)
        kept = await FrameClient.open(port)
        await until(lambda: registry.get_sample_value(
            "llm_sidecar_grpc_connections", {"service": "svc"}) == 2, timeout_s=10.0,
            what="two connections open")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        third = FrameClient(reader, writer)
        assert goaway(await third.until_closed()).error_code == f.ENHANCE_YOUR_CALM
        assert _closed(registry, "too_many_connections") == 1
        flooder.send(PingFrame(0, opaque_data=b"12345678").serialize() * 1_000)
        assert goaway(await flooder.until_closed()).error_code == f.ENHANCE_YOUR_CALM
        assert _closed(registry, "enhance_your_calm") == 1
        await until(lambda: registry.get_sample_value(
            "llm_sidecar_grpc_connections", {"service": "svc"}) == 1, timeout_s=10.0,
            what="the flooder's connection gone")
        await kept.close()
        await third.close()
        await flooder.close()
    finally:
        await server.stop(0)
