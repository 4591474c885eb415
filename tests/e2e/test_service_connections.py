"""Envoy keeps to the services' limit of streams per connection and opens more connections
under load (routing/render/clusters.py, sidecar_runtime.wire.names.GRPC_MAX_CONCURRENT_STREAMS).

ext_proc holds one gRPC stream per request in flight. Without a limit, Envoy put them all on
one connection per Envoy worker, and the kernel, which spreads connections (not streams) over
``--workers``, could not spread that load; the server also had no bound on the calls one
connection could open.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from sidecar_runtime.wire.names import GRPC_MAX_CONCURRENT_STREAMS
from tests.harness.gateway import default_doc, envoy_counter, running_gateway

pytestmark = pytest.mark.e2e

CONNECTIONS = r"cluster\.llm-sidecar-extproc\.upstream_cx_total$"
PEAK = r"cluster\.llm-sidecar-extproc\.upstream_rq_active$"


async def _chats(url: str, count: int) -> list[int]:
    body = {"model": "llama-2-13b", "max_tokens": 40,
            "messages": [{"role": "user", "content": "hi"}]}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count),
                                     timeout=timeout) as session:
        async def one() -> int:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()
                return response.status
        return await asyncio.gather(*(one() for _ in range(count)))


def test_more_requests_in_flight_than_a_connection_carries_open_more_connections(
        tmp_path: Any) -> None:
    doc = default_doc()
    # ~6 s a request: they are all in flight together, each holding its ext_proc stream, even
    # when a loaded machine takes seconds to send them all.
    doc["clusters"]["vllm-short"]["simulate"] = {"decode_ms_per_token": 150}
    count = 2 * GRPC_MAX_CONCURRENT_STREAMS + 50
    with running_gateway(doc, str(tmp_path)) as gw:
        assert asyncio.run(_chats(gw.url, 4)) == [200] * 4
        before = envoy_counter(gw.admin_url, CONNECTIONS)
        statuses = asyncio.run(_chats(gw.url, count))
        after = envoy_counter(gw.admin_url, CONNECTIONS)
    print("connections", before, after)
    assert statuses == [200] * count
    # Envoy's two workers held at most two connections before; 250 streams at 100 a
    # connection need at least three.
    assert after >= 3 and after > before
