"""extproc's own rate-limit calls (checks for cache hits, settlement batches) against the real
ratelimit process: plain and over mutual TLS from ``services.tls``, a reload that changes the
TLS files, and the service down. A check never raises and never waits past its deadline; a
settle is True only on an OK answer."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.actions import RateCheck, Verdict
from extproc.adapters.rls_client import RateLimitClient
from ratelimit.request_bounds import MAX_DESCRIPTORS
from ratelimit.service import RateLimitProcess, rate_limit_process
from routing.ratelimits import DOMAIN
from routing.schema import ServicesSection, ServicesTls
from sidecar_runtime.process.settings import Settings
from tests.harness.tls import TlsFiles, make_tls_files

YAML = """
version: 1
clusters: {pool: {endpoints: ["127.0.0.1:9"], max_context: 4096}}
models: {m: {clusters: [pool]}}
rate_limits:
  tenant: {default: {requests: 2/min}}
"""
DESCRIPTOR = (("kind", "requests"), ("tenant", "t"))
WAIT_S = 20.0
"""A bound for a client that hangs, not a performance figure."""


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
async def mutual_tls_server(tls_files: TlsFiles, tmp_path: Path,
                            ) -> AsyncIterator[RateLimitProcess]:
    config = tmp_path / "routing.yaml"
    config.write_text(YAML)
    settings = Settings(grpc_tls_cert_file=str(tls_files.server_cert),
                        grpc_tls_key_file=str(tls_files.server_key),
                        grpc_tls_client_ca_file=str(tls_files.ca_cert))
    server = rate_limit_process(str(config), "127.0.0.1", 0, 0, settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=0.5)


def check(target: str, tls: ServicesTls | None, timeout_s: float = 5) -> RateCheck:
    return RateCheck(target, DOMAIN, (DESCRIPTOR,), timeout_s, lambda verdict: verdict,  # type: ignore[arg-type,return-value]
                     tls)


async def test_checks_and_settles_over_mutual_tls_and_a_reload_of_the_files(
        mutual_tls_server: RateLimitProcess, tls_files: TlsFiles) -> None:
    target = f"127.0.0.1:{mutual_tls_server.port}"
    files = tls_files
    no_client_cert = ServicesTls(ca_file=str(files.ca_cert), server_name="localhost")
    mutual = ServicesTls(ca_file=str(files.ca_cert), server_name="localhost",
                         cert_file=str(files.client_cert), key_file=str(files.client_key))
    client = RateLimitClient(CollectorRegistry())
    try:
        # Without a client certificate the service refuses the connection: unavailable.
        assert (await client.check(check(target, no_client_cert))).result == "unavailable"
        assert (await client.check(check(target, None))).result == "unavailable"  # cleartext
        # A reload that adds the certificate: a new channel, and the service's verdicts.
        verdicts = [(await client.check(check(target, mutual))).result for _ in range(3)]
        assert verdicts == ["ok", "ok", "over_limit"]
        services = ServicesSection(ratelimit=target, tls=mutual, ratelimit_timeout_s=5)
        other = (("kind", "requests"), ("tenant", "other"))
        assert await client.settle(services, (other,))
        assert not await client.settle(services, (DESCRIPTOR,))  # OVER_LIMIT is not OK
        refused = (DESCRIPTOR,) * (MAX_DESCRIPTORS + 1)  # INVALID_ARGUMENT from the service
        assert not await client.settle(services, refused)
    finally:
        await client.aclose()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_service_down_is_an_unavailable_verdict_never_an_error(tmp_path: Path) -> None:
    client = RateLimitClient(CollectorRegistry())
    target = f"127.0.0.1:{closed_port()}"
    bad_files = ServicesTls(ca_file=str(tmp_path / "missing.crt"))
    try:
        for tls in (None, None, bad_files):
            verdict = await asyncio.wait_for(client.check(check(target, tls)), WAIT_S)
            assert verdict == Verdict("unavailable")
        services = ServicesSection(ratelimit=target, ratelimit_timeout_s=5)
        assert not await asyncio.wait_for(client.settle(services, (DESCRIPTOR,)), WAIT_S)
    finally:
        await client.aclose()


async def test_a_check_waits_no_longer_than_its_deadline() -> None:
    """A server that accepts and never answers: the verdict comes at the deadline."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65_536):
            pass
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = RateLimitClient(CollectorRegistry())
    try:
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        loop = asyncio.get_running_loop()
        started = loop.time()
        verdict = await asyncio.wait_for(client.check(check(target, None, timeout_s=0.3)),
                                         WAIT_S)
        assert verdict.result == "unavailable"
        assert loop.time() - started >= 0.3
    finally:
        await client.aclose()
        server.close()
