"""The rate limiter's own Redis connections read the URL as redis-py does: a password, an ACL
user, a database index, TLS with a CA and a client certificate; a refusal is a clear error
that never holds the secret."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from sidecar_runtime.redis.batch import CommandBatcher
from sidecar_runtime.redis.client import make_client
from sidecar_runtime.redis.conn import Endpoint
from tests.harness.fault_proxy import FaultProxy
from tests.harness.redis_fixtures import process_redis
from tests.harness.redis_servers import ProcessRedis
from tests.harness.tls import TlsFiles, make_tls_files

pytestmark = pytest.mark.redis

PASSWORD = "batch-pass-Hq42xV"
USER, USER_PASSWORD = "limiter", "acl-user-pass-9Tz"


@pytest.fixture(scope="module")
def password_redis() -> Iterator[ProcessRedis]:
    with process_redis(password=PASSWORD) as server:
        with server.client(socket_timeout=2) as admin:
            # An ACL user that may run scripts (and SET in them) and little else.
            admin.execute_command("ACL", "SETUSER", USER, "on", f">{USER_PASSWORD}", "~*",
                                  "+eval", "+evalsha", "+set", "+echo", "+select", "+acl|whoami")
        yield server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def mtls_redis(password_redis: ProcessRedis, tls_files: TlsFiles) -> Iterator[FaultProxy]:
    """TLS in front of the password server that requires a client certificate of the test CA."""
    proxy = FaultProxy("127.0.0.1", password_redis.port,
                       server_ssl=tls_files.server_context(require_client_cert=True)).start()
    try:
        yield proxy
    finally:
        proxy.stop()


async def batcher_for(url: str) -> AsyncIterator[CommandBatcher]:
    client = make_client(url, 1.0)
    assert isinstance(client, Redis)
    batcher = CommandBatcher(client)
    try:
        yield batcher
    finally:
        await batcher.aclose()
        await client.aclose()


async def run(url: str, *command: object) -> object:
    async for batcher in batcher_for(url):
        return await asyncio.wait_for(batcher.execute(*command), 10)
    raise AssertionError("unreachable")


async def test_a_password_and_a_database_index(password_redis: ProcessRedis) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{password_redis.port}/3"
    assert await run(url, "SET", "in-db-3", "yes") == b"OK"
    with password_redis.client(socket_timeout=2, db=3) as admin:
        assert admin.get("in-db-3") == b"yes"
    with password_redis.client(socket_timeout=2, db=0) as admin:
        assert admin.get("in-db-3") is None


async def test_the_password_as_a_url_parameter_and_the_db_as_one(
        password_redis: ProcessRedis) -> None:
    url = f"redis://127.0.0.1:{password_redis.port}?password={PASSWORD}&db=5"
    assert await run(url, "SET", "in-db-5", "yes") == b"OK"
    with password_redis.client(socket_timeout=2, db=5) as admin:
        assert admin.get("in-db-5") == b"yes"


async def test_an_acl_user(password_redis: ProcessRedis) -> None:
    url = f"redis://{USER}:{USER_PASSWORD}@127.0.0.1:{password_redis.port}/1"
    assert await run(url, "ACL", "WHOAMI") == USER.encode()
    assert await run(url, "EVAL", "return redis.call('SET', KEYS[1], 'x')", 1, "acl-key") == b"OK"


@pytest.mark.parametrize("userinfo", [":wrong-pass-Zq1", f"{USER}:wrong-pass-Zq1",
                                      f"nobody:{PASSWORD}"])
async def test_a_refused_login_is_a_clear_error_without_the_secret(
        password_redis: ProcessRedis, userinfo: str) -> None:
    url = f"redis://{userinfo}@127.0.0.1:{password_redis.port}/0"
    async for batcher in batcher_for(url):
        results = await asyncio.wait_for(asyncio.gather(
            *(batcher.execute("ECHO", "x") for _ in range(3)), return_exceptions=True), 10)
        for result in results:
            # AuthenticationError is a ConnectionError: the store retries once, then fails.
            assert isinstance(result, AuthenticationError), result
            text = f"{result} {result!r} {result.args}"
            assert "invalid username-password pair" in text
            assert "wrong-pass-Zq1" not in text and PASSWORD not in text
        assert batcher.in_flight == 0
        assert PASSWORD not in repr(batcher) and "wrong-pass" not in repr(batcher)


async def test_no_password_where_one_is_required_says_so(password_redis: ProcessRedis) -> None:
    with pytest.raises(AuthenticationError, match="Authentication required"):
        await run(f"redis://127.0.0.1:{password_redis.port}/0", "ECHO", "x")


def test_the_endpoint_keeps_the_secret_out_of_its_repr() -> None:
    client = make_client(f"rediss://{USER}:{USER_PASSWORD}@10.0.0.5:6380/2", 1.0)
    assert isinstance(client, Redis)
    endpoint = Endpoint.of(client)
    assert (endpoint.username, endpoint.password, endpoint.db) == (USER, USER_PASSWORD, 2)
    assert endpoint.tls is not None
    assert USER_PASSWORD not in repr(endpoint) and USER_PASSWORD not in str(endpoint)


async def test_tls_with_a_client_certificate(mtls_redis: FaultProxy, tls_files: TlsFiles) -> None:
    base = f"rediss://:{PASSWORD}@127.0.0.1:{mtls_redis.port}/0?ssl_ca_certs={tls_files.ca_cert}"
    with_cert = f"{base}&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.client_key}"
    assert await run(with_cert, "ECHO", "over tls") == b"over tls"
    with pytest.raises(RedisConnectionError) as refused:  # the proxy wants a certificate
        await run(base, "ECHO", "x")
    assert PASSWORD not in f"{refused.value} {refused.value!r}"


async def test_a_server_another_ca_signed_is_refused(mtls_redis: FaultProxy, tls_files: TlsFiles,
                                                    tmp_path: Path) -> None:
    other = make_tls_files(tmp_path / "other-ca")
    url = (f"rediss://:{PASSWORD}@127.0.0.1:{mtls_redis.port}/0?ssl_ca_certs={other.ca_cert}"
           f"&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.client_key}")
    with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED") as refused:
        await run(url, "ECHO", "x")
    assert PASSWORD not in f"{refused.value} {refused.value!r}"


async def test_the_tls_context_is_the_one_the_client_made(
        tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """Made once at start-up (~40 ms of CPU), not per connection (redis_client.py)."""
    import ssl

    client = make_client(f"rediss://:pw@127.0.0.1:1/0?ssl_ca_certs={tls_files.ca_cert}", 1.0)
    assert isinstance(client, Redis)
    pool = client.connection_pool
    connection = pool.connection_class(**pool.connection_kwargs)
    assert isinstance(connection, SSLConnection)
    shared = connection.ssl_context.get()
    made: list[object] = []
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1))
    assert Endpoint.of(client).tls is shared and made == []
    await client.aclose()
