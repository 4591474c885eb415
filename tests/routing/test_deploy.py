"""docker-compose.yml and deploy/k8s/: they parse, and every name they use exists.

``docker compose config`` (or ``docker-compose config``) checks the compose file where either exists;
``kubectl kustomize`` builds the manifests where kubectl exists (both need no cluster/engine).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from routing.artifacts import ROOT
from routing.loader import load_config
from routing.units import parse_hostport

REPO = pathlib.Path(ROOT)


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return doc


def hosts_of_routing(path: pathlib.Path) -> list[tuple[str, int]]:
    config = load_config(str(path))
    addresses = [config.services.extproc, config.services.ratelimit]
    addresses += [e for c in config.clusters.values() for e in c.endpoints]
    return [parse_hostport(a) for a in addresses]


def compose_cli() -> list[str] | None:
    """``docker compose`` (the plugin), else the standalone ``docker-compose``; None if neither."""
    docker = shutil.which("docker")
    if docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True,
                                             timeout=30, check=False).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone is not None else None


def test_docker_compose_config_accepts_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose here (neither the CLI plugin nor docker-compose)")
    result = subprocess.run([*cli, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_compose_names_line_up() -> None:
    services = compose()["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        for volume in service.get("volumes", []):
            host = volume.split(":", 1)[0]
            assert (REPO / host).is_dir(), (name, host)
        assert "healthcheck" in service, name
    for host, _ in hosts_of_routing(REPO / "deploy" / "compose" / "routing.yaml"):
        assert host in services, host
    for sidecar in ("llm-sidecar-extproc", "llm-sidecar-ratelimit"):
        url = services[sidecar]["environment"]["LLM_SIDECAR_REDIS_URL"]
        assert urlsplit(url).hostname in services


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((REPO / "deploy" / "k8s" / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / name).read_text()) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_kubernetes_names_line_up(tmp_path: pathlib.Path) -> None:
    docs = manifests()
    assert not [k for k, n in Counter((d["kind"], d["metadata"]["name"]) for d in docs).items()
                if n > 1]
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, name
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            port_names = {p["name"] for p in container.get("ports", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in container:
                    check = container[probe].get("httpGet") or container[probe].get("tcpSocket")
                    assert check["port"] in port_names, (name, probe)
        if not name.startswith("redis"):
            assert any("readinessProbe" in c for c in pod["spec"]["containers"]), name
    for name, service in services.items():
        selected = [d for d in deployments.values() if service["spec"]["selector"].items()
                    <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        container_ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"]
                           for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports, (name, port)
    routing = tmp_path / "routing.yaml"
    routing.write_text(configmaps["llm-sidecar-routing"]["data"]["routing.yaml"])
    for host, port in hosts_of_routing(routing):
        assert port in [p["port"] for p in services[host]["spec"]["ports"]], (host, port)
    for key in ("redis-buckets-url", "redis-cache-url"):
        redis = urlsplit(secrets["llm-sidecar"]["stringData"][key])
        assert redis.port in [p["port"] for p in services[str(redis.hostname)]["spec"]["ports"]]


def test_kubectl_kustomize_builds_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here")
    result = subprocess.run([kubectl, "kustomize", str(REPO / "deploy" / "k8s")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert len([d for d in yaml.safe_load_all(result.stdout) if d]) == len(manifests())
