"""Redis AUTH and TLS for the rate-limit buckets and the embedding cache, the warning about a
Redis without a password, and no password in logs, metrics, Redis keys or error bodies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar_runtime.process.procs import free_port, wait_http_ok
from sidecar_runtime.redis.audit import exposure
from sidecar_runtime.redis.url import UNPARSED
from tests.chaos.support import (
    DEADLINE_S,
    LOAD_KEY,
    cache_probe,
    chaos_doc,
    metric,
    rate_limit_probe,
    wait_until,
)
from tests.harness.gateway import Gateway, running_gateway
from tests.harness.redis_fixtures import process_redis, serving
from tests.harness.redis_servers import ProcessRedis
from tests.harness.redis_tls import TlsRedis, start_tls_redis
from tests.harness.tls import TlsFiles, make_tls_files

pytestmark = [pytest.mark.redis, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "tls-redis-pass-Kq7wZ2"
UNAUTH_EVENT = "redis_without_password"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(tls_files: TlsFiles) -> Iterator[TlsRedis]:
    with serving(lambda: start_tls_redis(tls_files, PASSWORD)) as server:
        yield server


@pytest.fixture(scope="module")
def tls_gw(tmp_path_factory: pytest.TempPathFactory, tls_redis: TlsRedis) -> Iterator[Gateway]:
    # The chaos rigs' deadline: a healthy TLS Redis sometimes misses 50 ms on a busy machine.
    env = {"LLM_SIDECAR_REDIS_URL": tls_redis.url,
           "LLM_SIDECAR_REDIS_TIMEOUT_MS": str(round(DEADLINE_S * 1000))}
    with running_gateway(chaos_doc(), str(tmp_path_factory.mktemp("gw-tls")), env=env,
                         capture_logs=True) as gw:
        yield gw


def test_buckets_and_cache_over_tls_with_a_password(tls_gw: Gateway, tls_redis: TlsRedis) -> None:
    print(f"\n[chaos] TLS Redis: {tls_redis.mode}")
    verdict = rate_limit_probe(tls_gw.url)
    assert verdict == "enforced", tls_gw.logs()[-3000:]
    first = cache_probe(tls_gw.url)
    assert first in ("miss", "hit")
    wait_until(lambda: cache_probe(tls_gw.url) == "hit", 10, 0.05)
    with tls_redis.client(socket_timeout=2) as client:
        keys = [key.decode() for key in client.keys("*")]
    assert keys, "nothing was written to the TLS Redis"
    for url in (tls_gw.extproc_metrics, tls_gw.ratelimit_metrics):
        assert metric(url, "llm_sidecar_redis_unauthenticated") == 0
    assert UNAUTH_EVENT not in tls_gw.logs()


def test_no_password_in_logs_metrics_keys_or_error_bodies(tls_gw: Gateway,
                                                          tls_redis: TlsRedis) -> None:
    texts = {"logs": tls_gw.logs()}
    for name, url in (("extproc metrics", tls_gw.extproc_metrics),
                      ("ratelimit metrics", tls_gw.ratelimit_metrics)):
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            texts[name] = resp.read().decode()
    with tls_redis.client(socket_timeout=2) as client:
        texts["redis keys"] = "\n".join(key.decode() for key in client.keys("*"))
    request = urllib.request.Request(
        f"{tls_gw.url}/v1/chat/completions", method="POST",
        data=json.dumps({"model": "nope", "messages": []}).encode(),
        headers={"authorization": f"Bearer {LOAD_KEY}", "content-type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=5)
    except urllib.error.HTTPError as err:
        texts["error body"] = err.read().decode()
    assert "error body" in texts
    for where, text in texts.items():
        for secret in (PASSWORD, LOAD_KEY):
            assert secret not in text, f"{secret[:6]}... leaked into {where}"
    assert ":***@" in texts["logs"], "the Redis URL should be logged with its password masked"


def run_service(kind: str, config: Path, env: dict[str, str],
                base: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    metrics_port = free_port()
    args = [sys.executable, "-m", "llm_sidecar", kind, "--config", str(config),
            "--port", str(free_port()), "--metrics-port", str(metrics_port)]
    process = subprocess.Popen(args, env={**(os.environ if base is None else base), **env},
                               cwd=ROOT,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    return process, metrics_port


def stop(process: subprocess.Popen[bytes]) -> str:
    process.terminate()
    try:
        _, err = process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err.decode(errors="replace")


@pytest.fixture(scope="module")
def plain_redis() -> Iterator[ProcessRedis]:
    with process_redis() as server:
        yield server


@pytest.mark.parametrize("dev_mode", [False, True])
def test_a_redis_without_password_is_loud_outside_dev_mode(
        tmp_path: Path, plain_redis: ProcessRedis, dev_mode: bool) -> None:
    import yaml

    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(chaos_doc()))
    env = {"LLM_SIDECAR_REDIS_URL": plain_redis.url,
           "LLM_SIDECAR_DEV_MODE": "true" if dev_mode else "false"}
    for kind in ("extproc", "ratelimit"):
        process, metrics_port = run_service(kind, config, env)
        try:
            wait_http_ok(f"http://127.0.0.1:{metrics_port}/healthz", 30)
            gauge = metric(f"http://127.0.0.1:{metrics_port}", "llm_sidecar_redis_unauthenticated")
        finally:
            stderr = stop(process)
        assert gauge == 1, kind  # a fact, dev mode or not: alerts can watch it
        warned = [json.loads(line) for line in stderr.splitlines()
                  if UNAUTH_EVENT in line and line.startswith("{")]
        if dev_mode:
            assert not warned, kind
        else:
            assert len(warned) == 1, (kind, stderr[-2000:])
            assert warned[0]["level"] == "warning" and warned[0]["service"].endswith(kind)


def test_a_missing_ca_file_stops_the_service_at_startup(tmp_path: Path,
                                                        tls_redis: TlsRedis) -> None:
    """A TLS setup that can never work must not look like a Redis outage forever (and, with
    ``allow``, silently admit everything): the service refuses to start and says why."""
    config = tmp_path / "ratelimit.yaml"
    config.write_text("domain: llm\ndescriptors:\n  - key: api_key\n"
                      "    rate_limit: {unit: hour, requests_per_unit: 1}\n")
    url = tls_redis.url.replace(str(tls_redis.files.ca_cert), str(tmp_path / "missing-ca.pem"))
    for kind in ("ratelimit", "extproc"):
        cfg = config if kind == "ratelimit" else tmp_path / "routing.yaml"
        if kind == "extproc":
            import yaml

            cfg.write_text(yaml.safe_dump(chaos_doc()))
        process, _ = run_service(kind, cfg, {"LLM_SIDECAR_REDIS_URL": url})
        try:
            code = process.wait(30)
        finally:
            stderr = stop(process) if process.poll() is None else \
                (process.stderr.read().decode() if process.stderr else "")
        assert code == 1, kind
        # One line, the same from both services, and no traceback.
        assert f"LLM_SIDECAR_REDIS_URL: Redis URL parameter ssl_ca_certs: no such file " \
               f"'{tmp_path / 'missing-ca.pem'}'\n" in stderr, (kind, stderr[-1500:])
        assert "Traceback" not in stderr, (kind, stderr[-1500:])
        assert PASSWORD not in stderr, kind


@pytest.mark.parametrize(("kind", "workers"), [("ratelimit", "1"), ("extproc", "1"),
                                               ("ratelimit", "2")])
def test_a_url_whose_password_is_not_encoded_stops_the_service_in_one_line(
        tmp_path: Path, kind: str, workers: str) -> None:
    """A password with ``/`` in it, not percent-encoded, spills into the port: redis-py's own
    message quoted its first part, and extproc printed a traceback. Both services, and the
    supervisor of ``--workers`` (once, not once per worker), say one line naming no part."""
    import yaml

    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(chaos_doc()))
    process, _ = run_service(kind, config, {
        "LLM_SIDECAR_REDIS_URL": "redis://:zq9K/wv7X@127.0.0.1:6379/0",
        "LLM_SIDECAR_WORKERS": workers})
    try:
        code = process.wait(30)
    finally:
        stderr = stop(process) if process.poll() is None else \
            (process.stderr.read().decode() if process.stderr else "")
    assert code == 1, (kind, stderr[-1500:])
    line = f"LLM_SIDECAR_REDIS_URL: {UNPARSED}\n"
    assert stderr.count(line) == 1 and "Traceback" not in stderr, (kind, stderr[-1500:])
    assert "zq9K" not in stderr and "wv7X" not in stderr, kind


async def test_a_certificate_from_another_ca_is_refused(tmp_path: Path, tls_redis: TlsRedis) -> None:
    """Verification is on: a server the configured CA did not sign is an error (and the
    services then apply their Redis-down policy), never a silent plaintext fallback."""
    from sidecar_runtime.redis.client import make_client

    other = make_tls_files(tmp_path / "other-ca")
    url = tls_redis.url.replace(str(tls_redis.files.ca_cert), str(other.ca_cert))
    client = make_client(url, 1.0)
    try:
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED") as caught:
            await client.ping()
        assert PASSWORD not in str(caught.value)
    finally:
        await client.aclose()
    good = make_client(tls_redis.url, 1.0)
    try:
        assert await good.ping()
    finally:
        await good.aclose()


def test_exposure_reads_only_the_url() -> None:
    assert exposure("redis://10.0.0.5:6379/0").password is False
    assert exposure("redis://10.0.0.5:6379/0?password=pw").password is True
    assert exposure("redis://10.0.0.5:6379/0?password=").password is False
    assert exposure("redis://default@10.0.0.5:6379/0").password is False
    found = exposure("rediss://:pw@redis.llm.svc:6380/0?ssl_ca_certs=/etc/ca.pem")
    assert (found.password, found.tls, found.loopback) == (True, True, False)
    assert exposure("redis+cluster://127.0.0.1:7000").loopback


@pytest.mark.parametrize("scheme", ["rediss", "rediss+cluster"])
async def test_tls_context_is_made_once_per_client(tls_files: TlsFiles, scheme: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py makes a TLS context per connection (≈40 ms of CPU loading the system CA
    store, longer than the whole Redis deadline); a client shares one, made at start-up.
    Counted, not timed: a 5 ms bound was missed by a preempted test on a loaded machine."""
    import ssl

    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import AbstractConnection, SSLConnection

    from sidecar_runtime.redis.client import make_client

    client = make_client(f"{scheme}://:pw@127.0.0.1:1/0?ssl_ca_certs={tls_files.ca_cert}", 0.05)
    try:
        cls: type[AbstractConnection]
        if isinstance(client, RedisCluster):
            node = next(iter(client.nodes_manager.startup_nodes.values()))
            cls, kwargs = node.connection_class, node.connection_kwargs
        else:
            cls, kwargs = client.connection_pool.connection_class, \
                client.connection_pool.connection_kwargs
        made: list[ssl.SSLContext] = []
        create = ssl.create_default_context

        def counted(*args: Any, **kw: Any) -> ssl.SSLContext:
            made.append(create(*args, **kw))
            return made[-1]

        monkeypatch.setattr(ssl, "create_default_context", counted)
        first, second = cls(**kwargs), cls(**kwargs)
        assert isinstance(first, SSLConnection) and isinstance(second, SSLConnection)
        assert first.ssl_context.get() is second.ssl_context.get()
        assert made == []  # both connections use the context made when the client was
    finally:
        await client.aclose()


URL_PARAMETER_PASSWORD = "qp-redis-pass-Zx81"


@pytest.fixture(scope="module")
def password_redis() -> Iterator[ProcessRedis]:
    with process_redis(password=URL_PARAMETER_PASSWORD) as server:
        yield server


@pytest.mark.parametrize("dev_mode", [False, True])
def test_a_password_given_as_a_url_parameter_is_masked_and_counts(
        tmp_path: Path, password_redis: ProcessRedis, dev_mode: bool) -> None:
    """``?password=`` is as good as ``:PASSWORD@`` to redis-py: it must be masked in the logs
    and must not make the services claim the Redis has no password. The key-id secret left at
    its public default is loud outside dev mode, and its gauge is set either way."""
    import yaml

    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(chaos_doc()))
    url = (f"redis://127.0.0.1:{password_redis.port}/0?password={URL_PARAMETER_PASSWORD}"
           "&socket_keepalive=true")
    env = {"LLM_SIDECAR_REDIS_URL": url, "LLM_SIDECAR_DEV_MODE": "true" if dev_mode else "false"}
    env.pop("LLM_SIDECAR_KEY_ID_SECRET", None)
    base = {k: v for k, v in os.environ.items() if k != "LLM_SIDECAR_KEY_ID_SECRET"}
    for kind in ("extproc", "ratelimit"):
        process, metrics_port = run_service(kind, config, env, base=base)
        metrics = f"http://127.0.0.1:{metrics_port}"
        try:
            wait_http_ok(f"{metrics}/healthz", 30)
            unauthenticated = metric(metrics, "llm_sidecar_redis_unauthenticated")
            secret_default = metric(metrics, "llm_sidecar_key_id_secret_default") \
                if kind == "extproc" else None
        finally:
            stderr = stop(process)
        assert URL_PARAMETER_PASSWORD not in stderr, kind
        assert "password=***" in stderr, (kind, stderr[-1500:])
        assert unauthenticated == 0 and UNAUTH_EVENT not in stderr, kind
        if kind == "extproc":
            assert secret_default == 1
            assert ("key_id_secret_default" in stderr) is not dev_mode


def test_a_secret_key_id_secret_is_quiet(tmp_path: Path) -> None:
    import yaml

    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(chaos_doc()))
    process, metrics_port = run_service("extproc", config, {
        "LLM_SIDECAR_KEY_ID_SECRET": "a-real-random-secret-9f2c"})
    try:
        wait_http_ok(f"http://127.0.0.1:{metrics_port}/healthz", 30)
        gauge = metric(f"http://127.0.0.1:{metrics_port}", "llm_sidecar_key_id_secret_default")
    finally:
        stderr = stop(process)
    assert gauge == 0 and "key_id_secret_default" not in stderr
