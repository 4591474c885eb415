"""Envoy ↔ extproc/ratelimit over Unix sockets and mutual TLS (a test CA), both at once: one
gateway shows each option works and that the services refuse whoever lacks a certificate."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.chaos.support import chaos_doc, chat_call, post, rate_limit_probe
from tests.harness.gateway import Gateway, running_gateway
from tests.harness.tls import TlsFiles, make_tls_files

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("grpc-tls"))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles) -> Iterator[Gateway]:
    sockets = tmp_path_factory.mktemp("sock")
    doc = chaos_doc()
    del doc["models"]["bge-m3"]["cache"]
    doc["services"].update(
        extproc=f"unix:{sockets}/extproc.sock", ratelimit=f"unix:{sockets}/ratelimit.sock",
        tls={"ca_file": str(tls_files.ca_cert), "server_name": "localhost",
             "cert_file": str(tls_files.client_cert), "key_file": str(tls_files.client_key)})
    env = {"LLM_SIDECAR_GRPC_TLS_CERT_FILE": str(tls_files.server_cert),
           "LLM_SIDECAR_GRPC_TLS_KEY_FILE": str(tls_files.server_key),
           "LLM_SIDECAR_GRPC_TLS_CLIENT_CA_FILE": str(tls_files.ca_cert)}
    with running_gateway(doc, str(tmp_path_factory.mktemp("gw-grpc")), env=env) as gateway:
        yield gateway


def health(target: str, credentials: grpc.ChannelCredentials | None) -> str:
    options = [("grpc.ssl_target_name_override", "localhost")]
    channel = (grpc.secure_channel(target, credentials, options) if credentials
               else grpc.insecure_channel(target))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=3)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_envoy_reaches_both_services_over_tls_on_unix_sockets(gw: Gateway) -> None:
    assert post(gw.url, chat_call()).status == 200  # routed by extproc
    assert rate_limit_probe(gw.url) == "enforced"  # limited by ratelimit


def test_services_refuse_clients_without_a_certificate(gw: Gateway, tls_files: TlsFiles) -> None:
    with open(gw.config_path, encoding="utf-8") as handle:
        services = yaml.safe_load(handle)["services"]
    ca = tls_files.ca_cert.read_bytes()
    with_cert = grpc.ssl_channel_credentials(ca, tls_files.client_key.read_bytes(),
                                             tls_files.client_cert.read_bytes())
    for name in ("extproc", "ratelimit"):
        target = services[name]
        assert health(target, None) == "UNAVAILABLE"  # plain text
        assert health(target, grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"  # no client cert
        assert health(target, with_cert) == "SERVING"
    print("\n[chaos] gRPC on Unix sockets over mutual TLS: Envoy served; plain text and "
          "certificate-less clients refused")


@pytest.mark.parametrize(("services", "message"), [
    ({"extproc": "unix:relative.sock"}, "unix:/absolute/path"),
    ({"tls": {"ca_file": "/ca.pem", "cert_file": "/c.pem"}}, "cert_file and key_file go together"),
])
def test_transport_config_mistakes_are_reported(tmp_path: object, services: dict[str, object],
                                                message: str) -> None:
    from pathlib import Path

    from routing.errors import ConfigError
    from routing.loader import load_config

    doc = chaos_doc()
    doc["services"].update(services)
    path = Path(str(tmp_path)) / "routing.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))
