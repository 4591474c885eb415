"""docker-compose.yml and deploy/k8s/: they are valid, and every name they use exists.

Every run validates the manifests without a cluster: ``kubernetes-validate`` (the Kubernetes
OpenAPI schemas, strict: unknown fields are errors). The compose file's names are checked
against the routing YAML it mounts; its schema is left to ``docker compose config`` (a Python
compose validator with no known maintainer was tried and not adopted as a test dependency).
``kubectl kustomize`` needs no cluster and kubectl is on the machine image, so it runs too (in CI
a missing kubectl is a failure). ``docker compose config`` needs the compose plugin, which no
development or CI machine has: it runs only with ``LLM_SIDECAR_TEST_DEPLOY_TOOLS=1`` (then a
missing plugin is a failure); otherwise pytest reports it deselected, never skipped.
"""

from __future__ import annotations

import copy
import pathlib
import shutil
import subprocess
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_validate import ValidationError, latest_version, validate

from routing.loader import load_config
from routing.render.artifacts import ROOT
from routing.units import parse_hostport
from tests.harness.ci import DEPLOY_TOOLS_ENV
from tests.harness.kubectl import kustomize

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


@pytest.mark.deploy_tools
def test_docker_compose_config_accepts_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.fail(f"{DEPLOY_TOOLS_ENV} is set, but there is no docker compose here "
                    "(neither the CLI plugin nor docker-compose)", pytrace=False)
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


def kind_and_name(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


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


def test_every_manifest_matches_its_kubernetes_schema() -> None:
    failures = []
    for doc in manifests():
        try:
            validate(doc, latest_version(), strict=True)
        except ValidationError as err:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert failures == []


def test_the_schema_check_catches_a_broken_manifest() -> None:
    deployment = copy.deepcopy(next(d for d in manifests() if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(ValidationError, match="'imagePullPolcy' was unexpected"):
        validate(deployment, latest_version(), strict=True)


def test_the_kustomization_only_lists_resources() -> None:
    """Then ``kubectl kustomize`` outputs exactly the listed files' documents, which is what
    ``manifests()`` reads: no patches, generators or name prefixes it would have to apply."""
    kustomization = yaml.safe_load((REPO / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    assert sorted(p.name for p in (REPO / "deploy" / "k8s").glob("*.yaml")) == sorted(
        ["kustomization.yaml", *kustomization["resources"]])


def test_kubectl_kustomize_builds_the_manifests() -> None:
    """kubectl ships on this project's machine image (so CI runs this); ``kustomize`` needs no
    cluster. Its output is exactly the documents the other tests read."""
    built = kustomize(REPO / "deploy" / "k8s")
    assert sorted(built, key=kind_and_name) == sorted(manifests(), key=kind_and_name)
