"""deploy/operator/: fresh, valid for the Kubernetes API, buildable by kustomize, wired together
(service account, Role, binding, the container's flags and probe) and least-privileged.

``tests/llmmodel/test_operator.py`` checks the Role against the requests the operator really
makes; here the Role is checked for what it must never hold."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import pathlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import jsonpatch
import kopf
import pytest
import yaml
from aiohttp import web
from kubernetes_validate import latest_version, validate

from llmmodel.kube_api import PLURALS, InClusterApi
from llmmodel.operator import default_toolkit
from llmmodel.operator_cli import add_operator_arguments, kopf_settings, register_handlers
from llmmodel.operator_deploy import OUT, ROOT, artifacts, main
from llmmodel.operator_prune import PRUNED_KINDS
from sidecar_runtime.process.files import stale_files
from tests.harness.kubectl import kustomize
from tests.llmmodel.test_operator import BASE, NS, SETTINGS, llmmodel

HAND_WRITTEN = ("clusters: {hand: {endpoints: ['10.0.0.1:8000'], max_context: 4096}}\n"
                "models: {hand-written: {clusters: [hand]}}\n")

DIR = pathlib.Path(ROOT) / OUT


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DIR / name).read_text()) if d]
    return docs


def one(kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind]
    return doc


def test_the_checked_in_manifests_are_fresh(capsys: pytest.CaptureFixture[str]) -> None:
    assert stale_files(artifacts(), ROOT) == []
    assert main(["--check"]) == 0
    assert capsys.readouterr().err == ""
    assert artifacts() == artifacts()  # deterministic


def test_the_kustomization_lists_every_file_and_only_resources() -> None:
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    assert sorted(p.name for p in DIR.glob("*.yaml")) == sorted(
        ["kustomization.yaml", *kustomization["resources"]])


def test_every_manifest_matches_its_kubernetes_schema() -> None:
    kinds = [d["kind"] for d in documents()]
    assert kinds == ["CustomResourceDefinition", "ServiceAccount", "Role", "RoleBinding", "Deployment"]
    for doc in documents():
        validate(doc, latest_version(), strict=True)


def test_kubectl_kustomize_builds_them() -> None:
    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    built = kustomize(DIR)
    assert sorted(built, key=key) == sorted(documents(), key=key)


def test_the_role_is_least_privilege() -> None:
    assert not [d for d in documents() if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    rules = one("Role")["rules"]
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(field, []), rule
    verbs = {verb for rule in rules for verb in rule["verbs"]}
    assert verbs <= {"get", "list", "watch", "create", "patch", "delete"}  # no update, no deletecollection
    watched = {res for rule in rules if "watch" in rule["verbs"] for res in rule["resources"]}
    assert watched == {"llmmodels"}
    # list and delete: only the kinds of a model's objects (pruning what a spec edit dropped)
    pruned = {plural for (_, kind), plural in PLURALS.items() if kind not in ("ConfigMap", "LLMModel")}
    assert pruned == {PLURALS[key] for key in PRUNED_KINDS}
    listed = {res for rule in rules if "list" in rule["verbs"] for res in rule["resources"]}
    assert listed == pruned | {"llmmodels"}
    deleted = {res for rule in rules if "delete" in rule["verbs"] for res in rule["resources"]}
    assert deleted == pruned
    dangerous = {"secrets", "pods", "roles", "rolebindings"}
    assert [rule for rule in rules if dangerous & set(rule["resources"])] == []
    configmaps = [rule for rule in rules if "configmaps" in rule["resources"]]
    assert all(rule.get("resourceNames") for rule in configmaps)


def test_the_pieces_are_wired_together() -> None:
    account, binding, deployment = one("ServiceAccount"), one("RoleBinding"), one("Deployment")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": one("Role")["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    [container] = pod["containers"]
    assert container["args"][0] == "operator"
    parser = argparse.ArgumentParser()
    add_operator_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.standalone
    liveness = urlsplit(args.liveness)
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (liveness.path, liveness.port) == (probe["path"], ports[probe["port"]])
    guard = container["securityContext"]
    assert guard["readOnlyRootFilesystem"] and not guard["allowPrivilegeEscalation"]
    assert guard["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"]
    assert container["resources"]["limits"]["memory"]


class FakeApiServer:
    """A stand-in kube-apiserver for kopf and :class:`InClusterApi`: discovery for the LLMModel
    group, list (by label too)/watch/get, the three patch types kopf and server-side apply send,
    delete, events, and RBAC: a request the Role does not allow gets 403 and is recorded in ``denied``."""

    def __init__(self, role: list[dict[str, Any]]) -> None:
        self.role = role
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.denied: list[str] = []
        self.deleted: list[str] = []
        self.version = 0
        self.watchers: list[asyncio.Queue[dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self.closed = False

    def allowed(self, verb: str, group: str, resource: str, namespace: str | None, name: str | None) -> bool:
        return namespace is not None and any(
            group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            and ("resourceNames" not in r or name in r["resourceNames"]) for r in self.role)

    def store(self, group: str, plural: str, obj: dict[str, Any], event: str = "MODIFIED") -> None:
        self.version += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self.version)
        key = (group, plural, meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects.pop(key, None)
            event = "DELETED"
        else:
            self.objects[key] = obj
        if plural == "llmmodels":
            for queue in self.watchers:
                queue.put_nowait({"type": event, "object": copy.deepcopy(obj)})
        self.changed.set()

    def delete(self, name: str) -> None:
        """``kubectl delete llmmodel NAME``: held by its finalizers, if any."""
        obj = copy.deepcopy(self.objects[("llm-sidecar.dev", "llmmodels", NS, name)])
        obj["metadata"]["deletionTimestamp"] = "2026-12-07T12:00:00Z"
        self.store("llm-sidecar.dev", "llmmodels", obj)

    async def until(self, condition: Callable[[], bool], within: float = 20) -> None:
        try:
            async with asyncio.timeout(within):
                while not condition():
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"not reached in {within} s; requests refused: {self.denied}") from None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        where = split_path(request.path)
        if where is None:
            return web.json_response(DISCOVERY.get(request.path, {"resources": []}))
        group, namespace, plural, name, sub = where
        watch = request.query.get("watch") == "true"
        verb = {"GET": "watch" if watch else ("get" if name else "list"), "POST": "create",
                "PATCH": "patch", "DELETE": "delete"}[request.method]
        resource = f"{plural}/{sub}" if sub else plural
        if not self.allowed(verb, group, resource, namespace, name):
            self.denied.append(f"{verb} {request.path}")
            return web.json_response({"kind": "Status", "code": 403, "message": "forbidden"}, status=403)
        if plural == "events":
            self.events.append(await request.json())
            self.changed.set()
            return web.json_response({}, status=201)
        if watch:
            return await self.stream(request)
        key = (group, plural, namespace or "", name or "")
        if verb == "list":
            wanted = [term.partition("=")[::2] for term in request.query.get("labelSelector", "").split(",")
                      if term]
            items = [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self.objects.items())
                     if (g, p, ns) == key[:3] and all(
                         (o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted)]
            return web.json_response({"metadata": {"resourceVersion": str(self.version)}, "items": items})
        current = self.objects.get(key)
        if verb == "get":
            return web.json_response(current) if current else web.json_response({}, status=404)
        if verb == "delete":  # no finalizers on what the operator deletes: gone at once
            if self.objects.pop(key, None) is None:
                return web.json_response({"kind": "Status", "code": 404}, status=404)
            self.deleted.append(f"{plural}/{name} {request.query.get('propagationPolicy')}")
            self.changed.set()
            return web.json_response({"kind": "Status", "status": "Success"})
        return await self.patch(request, key, current, sub)

    async def patch(self, request: web.Request, key: tuple[str, str, str, str],
                    current: dict[str, Any] | None, sub: str | None) -> web.StreamResponse:
        group, plural, namespace, name = key
        kind = request.headers["Content-Type"]
        body = await request.json()
        if kind == "application/apply-patch+yaml":
            if current is None and not self.allowed("create", group, plural, namespace, name):
                self.denied.append(f"create {request.path}")
                return web.json_response({"kind": "Status", "code": 403}, status=403)
            new = {**body, **({"status": current["status"]} if current and "status" in current else {})}
        elif current is None:
            return web.json_response({}, status=404)
        elif kind == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(current, body)
            except jsonpatch.JsonPatchTestFailed:
                return web.json_response({"kind": "Status", "code": 422}, status=422)
        else:  # merge patch: the status subresource takes only .status, the object all else
            new = copy.deepcopy(current)
            if sub == "status":
                new["status"] = merge(current.get("status", {}), body.get("status", {}))
            else:
                new = merge(current, {k: v for k, v in body.items() if k != "status"})
        self.store(group, plural, new)
        return web.json_response(new)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.watchers.append(queue)
        try:
            while not self.closed:
                try:
                    event = await asyncio.wait_for(queue.get(), 0.2)
                except TimeoutError:
                    continue
                await response.write(json.dumps(event).encode() + b"\n")
        except ConnectionResetError:
            pass
        finally:
            self.watchers.remove(queue)
        return response


def split_path(path: str) -> tuple[str, str | None, str, str | None, str | None] | None:
    """(group, namespace, plural, name, subresource) of a resource path; None for discovery."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1] if len(parts) > 1 else "", parts[3:])
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    name, sub = [*rest[1:], None, None][:2]
    return group, namespace, rest[0], name, sub


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


DISCOVERY: dict[str, Any] = {
    "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0"},
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "events", "singularName": "event", "namespaced": True, "kind": "Event",
         "verbs": ["create", "get", "list", "watch"]},
        {"name": "namespaces", "singularName": "namespace", "namespaced": False,
         "kind": "Namespace", "verbs": ["get", "list", "watch"]}]},
    "/apis": {"kind": "APIGroupList", "groups": [{
        "name": "llm-sidecar.dev",
        "versions": [{"groupVersion": "llm-sidecar.dev/v1alpha1", "version": "v1alpha1"}],
        "preferredVersion": {"groupVersion": "llm-sidecar.dev/v1alpha1", "version": "v1alpha1"}}]},
    "/apis/llm-sidecar.dev/v1alpha1": {"kind": "APIResourceList", "resources": [
        {"name": "llmmodels", "singularName": "llmmodel", "namespaced": True, "kind": "LLMModel",
         "shortNames": ["llmm"], "verbs": ["get", "list", "watch", "patch", "create", "delete"]},
        {"name": "llmmodels/status", "singularName": "", "namespaced": True, "kind": "LLMModel",
         "verbs": ["get", "patch"]}]},
}


async def test_kopf_runs_the_operator_within_its_role(tmp_path: pathlib.Path) -> None:
    """The handlers under the real kopf, talking to a stand-in API server that enforces the
    deployed Role: create → objects, routing and status; delete → out of routing, finalizer
    released. No request kopf or the operator makes is refused."""
    server = FakeApiServer(one("Role")["rules"])
    model = llmmodel()
    model["metadata"]["uid"] = "6f1c"
    server.store("", "configmaps", {"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": "llm-sidecar-routing-base", "namespace": NS},
                                    "data": {"routing.yaml": BASE + HAND_WRITTEN}})
    server.store("llm-sidecar.dev", "llmmodels", model)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    registry = kopf.OperatorRegistry()
    api = InClusterApi(base_url=url, account_dir=str(tmp_path))
    register_handlers(registry, api, SETTINGS, default_toolkit(SETTINGS))

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, token="operator")

    settings = kopf_settings()
    stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(
        registry=registry, settings=settings, standalone=True, namespaces=[NS], stop_flag=stop))
    key = ("llm-sidecar.dev", "llmmodels", NS, "contract-review-v2")

    def planned() -> bool:
        status = server.objects[key].get("status", {})
        return any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions", []))

    try:
        await server.until(planned)
        stored = server.objects[key]
        assert stored["metadata"]["finalizers"] == ["llm-sidecar.dev/operator"]
        assert set(stored["status"]) == {"plan", "conditions", "observedGeneration"}  # nothing of kopf's
        routing = server.objects[("", "configmaps", NS, "llm-sidecar-routing")]["data"]["routing.yaml"]
        assert "contract-review-v2" in yaml.safe_load(routing)["models"]
        deployments = [o for (g, p, _, _), o in server.objects.items() if p == "deployments"]
        assert len(deployments) == 2
        assert all(d["metadata"]["ownerReferences"][0]["uid"] == "6f1c" for d in deployments)
        # replicas {min: 1, max: 4}: an HPA per pool, applied within the Role too
        hpas = [o for (g, p, _, _), o in server.objects.items()
                if (g, p) == ("autoscaling", "horizontalpodautoscalers")]
        assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == sorted(
            d["metadata"]["name"] for d in deployments)
        await server.until(lambda: ("Normal", "Planned") in [(e["type"], e["reason"]) for e in server.events])
        assert server.events[0]["involvedObject"]["uid"] == "6f1c"

        # an edit dropping the 4k context: its pool is routed away, then deleted (within the Role)
        edited = copy.deepcopy(server.objects[key])
        edited["spec"]["contexts"] = [2048]
        edited["metadata"]["generation"] = 2
        server.store("llm-sidecar.dev", "llmmodels", edited)
        await server.until(lambda: "Pruned" in [e["reason"] for e in server.events])
        routing = server.objects[("", "configmaps", NS, "llm-sidecar-routing")]["data"]["routing.yaml"]
        assert "contract-review-v2-4k" not in routing
        assert sorted(n for (_, p, _, n) in server.objects if p == "deployments") == ["contract-review-v2-2k"]
        assert "deployments/contract-review-v2-4k Background" in server.deleted
        assert [n for (_, _, _, n) in server.objects if n.endswith("-4k")] == []

        server.delete("contract-review-v2")
        await server.until(lambda: key not in server.objects)
        routing = server.objects[("", "configmaps", NS, "llm-sidecar-routing")]["data"]["routing.yaml"]
        assert set(yaml.safe_load(routing)["models"]) == {"hand-written"}
        assert server.denied == []
    finally:
        # kopf waits up to 5 s for every task started after it, the server's too: end them first
        server.closed = True
        await api.close()
        stop.set()
        await operator
        await runner.cleanup()
