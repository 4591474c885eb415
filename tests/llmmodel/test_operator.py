"""The operator's reconcile, called as kopf would call it, against an in-memory Kubernetes API.

No kube-apiserver runs here: :class:`FakeApi` keeps objects as a server-side apply would leave
them (the last applied body wins, status apart) and records every call, so the tests assert what
a cluster would end up holding: the planned objects owned by the LLMModel, a routing ConfigMap
that ``llm-sidecar check`` passes, and the status a user reads with ``kubectl get llmm``.
The planner, object writer and routing merge are the real ones.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import pathlib
from collections.abc import Sequence
from typing import Any, cast

import kopf
import pytest
import yaml
from aiohttp import web
from kopf._core.engines import posting

from llmmodel.catalog import load_gpus
from llmmodel.k8s import model_objects
from llmmodel.kube_api import PLURALS, InClusterApi, KubeApiError, resource_path
from llmmodel.operator import reconcile, refresh, refresh_pools_ready, remove
from llmmodel.operator_cli import add_operator_arguments, operator_command, pod_namespace, register_handlers
from llmmodel.operator_deploy import rules
from llmmodel.operator_handover import HANDOVER_MANAGER
from llmmodel.operator_plan import OperatorSettings, Toolkit, default_toolkit, plan_namespace
from llmmodel.planner import plan_models
from llmmodel.plans import ModelPlan
from llmmodel.spec import LoadedModel, model_from_object
from routing.errors import ConfigError
from routing.loader import check_config

NS = "llm"
POOL_KINDS = {"Deployment", "HorizontalPodAutoscaler", "Service", "NetworkPolicy", "InferencePool",
              "PodMonitor"}
"""The kinds of a pool's objects (of a model with ``replicas.max`` above ``min``)."""
SETTINGS = OperatorSettings(namespace=NS)
BASE = ("version: 1\n"
        "services: {extproc: llm-sidecar-extproc:50051, ratelimit: llm-sidecar-ratelimit:50052}\n")


def llmmodel(name: str = "contract-review-v2", **spec: Any) -> dict[str, Any]:
    """An LLMModel as the API server returns it (the field notes' example by default)."""
    fields = {"modelPath": "hf://meta-llama/Llama-2-13b-chat-hf", "base": "llama-2-13b",
              "gpuRequest": "40Gi", "sla": {"p99Latency": "200ms", "availability": "99.95%"},
              "replicas": {"min": 1, "max": 4}, "limits": {"model": {"requests": "40/s"}}}
    fields.update(spec)
    return {"apiVersion": "llm-sidecar.dev/v1alpha1", "kind": "LLMModel",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": fields}


class FakeApi:
    """:class:`llmmodel.kube_api.KubeApi` in memory; ``calls`` holds (verb, apiVersion, kind,
    name) of each request, as RBAC would see it (an apply of a missing object is a create)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str, str]] = []
        self.managers: list[tuple[str, str, str]] = []
        """(field manager, kind, name) of each apply."""
        self.version = 0

    def bump(self, obj: dict[str, Any]) -> None:
        """A write: the object's resourceVersion changes, as etcd's revision does."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)

    def put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.bump(obj)
        self.objects[obj["apiVersion"], obj["kind"], meta.get("namespace", NS), meta["name"]] = obj

    def applied(self) -> list[tuple[str, str]]:
        return [(kind, name) for verb, _, kind, name in self.calls if verb in ("create", "patch")
                and not kind.startswith("LLMModel")]

    async def apply(self, obj: dict[str, Any], *, field_manager: str = "llm-sidecar") -> None:
        """Server-side apply, forced. A Deployment's ``spec.replicas`` follows its rules of
        ownership (``managedFields``): a manager that sends it owns it; one that stops sending it
        gives it up, and a field no manager owns falls back to its default (1). Another manager
        may only apply that one field (the handover)."""
        assert field_manager in ("llm-sidecar", HANDOVER_MANAGER)
        meta = obj["metadata"]
        key = (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        self.calls.append(("patch" if key in self.objects else "create", *key[:2], key[3]))
        self.managers.append((field_manager, obj["kind"], meta["name"]))
        live = self.objects.get(key)
        if field_manager != "llm-sidecar":
            assert live is not None and obj["kind"] == "Deployment" and set(obj["spec"]) == {"replicas"}
            live["spec"]["replicas"] = obj["spec"]["replicas"]
            self.own_replicas(live, self.replica_owners(live) | {field_manager})
            self.bump(live)
            return
        kept = {"status": live["status"]} if live is not None and "status" in live else {}
        new = {**copy.deepcopy(obj), **kept}
        if obj["kind"] == "Deployment":
            sends = "replicas" in obj["spec"]
            owners = (self.replica_owners(live) if live is not None else set()) - {"llm-sidecar"}
            if sends:
                owners.add("llm-sidecar")
            elif live is not None and "replicas" in live["spec"]:
                new["spec"]["replicas"] = live["spec"]["replicas"] if owners else 1
            self.own_replicas(new, owners)
        self.objects[key] = new
        self.bump(self.objects[key])

    @staticmethod
    def replica_owners(obj: dict[str, Any]) -> set[str]:
        return {m["manager"] for m in obj["metadata"].get("managedFields", [])
                if "f:replicas" in m["fieldsV1"].get("f:spec", {})}

    @staticmethod
    def own_replicas(obj: dict[str, Any], owners: set[str]) -> None:
        obj["metadata"]["managedFields"] = [
            {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
            for m in sorted(owners)]

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", api_version, kind, name))
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def list_llmmodels(self, namespace: str) -> list[dict[str, Any]]:
        self.calls.append(("list", "llm-sidecar.dev/v1alpha1", "LLMModel", ""))
        return [copy.deepcopy(o) for (_, kind, ns, _), o in sorted(self.objects.items())
                if kind == "LLMModel" and ns == namespace]

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.calls.append(("patch", "llm-sidecar.dev/v1alpha1", "LLMModel/status", name))
        obj = self.objects[("llm-sidecar.dev/v1alpha1", "LLMModel", namespace, name)]
        obj["status"] = {**obj.get("status", {}), **copy.deepcopy(status)}
        self.bump(obj)

    async def list_labelled(self, api_version: str, kind: str, namespace: str,
                            selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list", api_version, kind, ""))
        label, _, value = selector.partition("=")
        return [copy.deepcopy(o) for (v, k, ns, _), o in sorted(self.objects.items())
                if (v, k, ns) == (api_version, kind, namespace)
                and (o["metadata"].get("labels") or {}).get(label) == value]

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", api_version, kind, name))
        self.objects.pop((api_version, kind, namespace, name), None)

    def routing(self) -> dict[str, Any]:
        cm = self.objects[("v1", "ConfigMap", NS, "llm-sidecar-routing")]
        doc: dict[str, Any] = yaml.safe_load(cm["data"]["routing.yaml"])
        return doc

    def model(self, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.objects[("llm-sidecar.dev/v1alpha1", "LLMModel", NS, name)])

    def set_ready(self, ready: int) -> None:
        for (_, kind, _, _), obj in self.objects.items():
            if kind == "Deployment":
                obj["status"] = {"readyReplicas": ready}


@pytest.fixture
def api() -> FakeApi:
    fake = FakeApi()
    fake.put({"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "llm-sidecar-routing-base", "namespace": NS},
              "data": {"routing.yaml": BASE}})
    return fake


@pytest.fixture(scope="module")
def toolkit() -> Toolkit:
    return default_toolkit(SETTINGS)


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


async def test_a_good_model_gets_its_objects_routes_and_status(
        api: FakeApi, toolkit: Toolkit, tmp_path: pathlib.Path) -> None:
    obj = llmmodel()
    api.put(obj)
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, obj, settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e), now=lambda: "2026-12-07T12:00:00Z")

    plan = plan_models([model_from_object(obj, f"{NS}/contract-review-v2")], load_gpus(None))[0]
    expected = model_objects(plan, namespace=NS)
    assert {(o["kind"], o["metadata"]["name"]) for o in expected} <= set(api.applied())
    for want in expected:
        got = api.objects[(want["apiVersion"], want["kind"], NS, want["metadata"]["name"])]
        assert got["metadata"]["ownerReferences"] == [{
            "apiVersion": "llm-sidecar.dev/v1alpha1", "kind": "LLMModel",
            "name": "contract-review-v2", "uid": "uid-contract-review-v2", "controller": True}]
        assert got["spec"] == want["spec"]

    routing = tmp_path / "routing.yaml"
    routing.write_text(api.objects[("v1", "ConfigMap", NS, "llm-sidecar-routing")]["data"]["routing.yaml"])
    check_config(str(routing))
    header = routing.read_text().split("\n", 2)[:2]
    assert header == [f"# Written by `llm-sidecar operator` from the base ConfigMap (configmap/"
                      f"llm-sidecar-routing-base/routing.yaml) and every LLMModel of namespace {NS}:",
                      "# edit those, not this; it is rewritten on every change."]
    assert "contract-review-v2" in api.routing()["models"]
    assert sorted(api.routing()["models"]["contract-review-v2"]["clusters"]) == sorted(
        p.name for p in plan.pools)

    assert status["plan"] == plan.as_json()
    assert status["observedGeneration"] == 1
    cond = conditions(status)
    assert (cond["Planned"]["status"], cond["Routed"]["status"], cond["PoolsReady"]["status"]) == (
        "True", "True", "False")
    assert "0/1 ready" in cond["PoolsReady"]["message"]
    assert all(c["lastTransitionTime"] == "2026-12-07T12:00:00Z" for c in cond.values())
    assert api.model("contract-review-v2")["status"] == status
    assert ("Normal", "Planned") in [e[:2] for e in events]

    api.set_ready(1)
    stored = api.model("contract-review-v2")
    after = await refresh_pools_ready(api, stored, settings=SETTINGS, toolkit=toolkit,
                                      now=lambda: "2026-12-07T12:05:00Z")
    assert after is not None
    cond = conditions(api.model("contract-review-v2")["status"])
    assert cond["PoolsReady"]["status"] == "True"
    assert cond["PoolsReady"]["lastTransitionTime"] == "2026-12-07T12:05:00Z"
    assert cond["Planned"]["lastTransitionTime"] == "2026-12-07T12:00:00Z"
    assert await refresh_pools_ready(api, api.model("contract-review-v2"), settings=SETTINGS,
                                     toolkit=toolkit) is None  # nothing changed: no write


async def test_an_unfittable_spec_applies_nothing_and_says_why(api: FakeApi, toolkit: Toolkit) -> None:
    obj = llmmodel(base="llama-2-70b", gpuRequest="1Gi")
    api.put(obj)
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, obj, settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e))
    assert api.applied() == []
    planned = conditions(status)["Planned"]
    assert planned["status"] == "False"
    assert planned["message"].startswith(
        "llm/contract-review-v2:1: pool contract-review-v2-2k fits no GPU of the built-in catalog")
    assert "plan" not in status
    assert conditions(status)["Routed"]["status"] == "False"
    assert conditions(api.model("contract-review-v2")["status"])["Planned"]["status"] == "False"
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "InvalidSpec")]

    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                    emit=lambda *e: events.append(e))
    assert len(events) == 1  # the same failure is not announced twice


@pytest.mark.parametrize("spec", [
    {"modelPath": "/"},
    {"modelPath": "/var/run/containerd"},
    {"canary": {"model": "contract-review-v3", "percent": 5, "modelPath": "/etc"}},
])
async def test_a_node_path_is_refused_unless_the_operator_allows_it(
        api: FakeApi, toolkit: Toolkit, spec: dict[str, Any]) -> None:
    """Whoever may create an LLMModel must not get a directory of a GPU node mounted into a
    pod the operator creates (hostPath), unless the operator was started to allow it."""
    obj = llmmodel(**spec)
    api.put(obj)
    status = await reconcile(api, obj, settings=SETTINGS, toolkit=toolkit)
    assert api.applied() == []
    planned = conditions(status)["Planned"]
    assert planned["status"] == "False"
    assert "hostPath" in planned["message"] and "--allow-host-paths" in planned["message"]
    assert planned["message"].startswith("llm/contract-review-v2:1: ")

    allowing = OperatorSettings(namespace=NS, allow_host_paths=True)
    status = await reconcile(api, api.model("contract-review-v2"), settings=allowing,
                             toolkit=default_toolkit(allowing))
    assert conditions(status)["Planned"]["status"] == "True"
    volumes = [v for (_, kind, _, _), d in api.objects.items() if kind == "Deployment"
               for v in d["spec"]["template"]["spec"]["volumes"]]
    assert any(v.get("hostPath", {}).get("path") == spec.get("modelPath", "/etc") for v in volumes)


async def test_an_allowed_node_path_must_still_be_absolute(api: FakeApi) -> None:
    allowing = OperatorSettings(namespace=NS, allow_host_paths=True)
    obj = llmmodel(modelPath="models/llama")
    api.put(obj)
    status = await reconcile(api, obj, settings=allowing, toolkit=default_toolkit(allowing))
    assert api.applied() == []
    message = conditions(status)["Planned"]["message"]
    assert message.startswith("llm/contract-review-v2:1: 'models/llama' is relative: ")


async def test_a_field_error_names_the_object(api: FakeApi, toolkit: Toolkit) -> None:
    obj = llmmodel(gpuRequest="lots")
    api.put(obj)
    status = await reconcile(api, obj, settings=SETTINGS, toolkit=toolkit)
    assert api.applied() == []
    assert conditions(status)["Planned"]["message"].startswith("llm/contract-review-v2:1: ")
    assert "'lots' is not a size" in conditions(status)["Planned"]["message"]


async def test_last_transition_time_moves_only_when_a_status_flips(
        api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    first = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS,
                            toolkit=toolkit, now=lambda: "2026-12-07T12:00:00Z")
    again = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS,
                            toolkit=toolkit, now=lambda: "2026-12-07T13:00:00Z")
    assert again["conditions"] == first["conditions"]

    broken = api.model("contract-review-v2")
    broken["spec"]["gpuRequest"] = "1Gi"
    broken["spec"]["base"] = "llama-2-70b"
    broken["metadata"]["generation"] = 2
    api.put(broken)
    third = await reconcile(api, broken, settings=SETTINGS, toolkit=toolkit,
                            now=lambda: "2026-12-07T14:00:00Z")
    cond = conditions(third)
    assert (cond["Planned"]["status"], cond["Planned"]["lastTransitionTime"]) == (
        "False", "2026-12-07T14:00:00Z")
    assert cond["Routed"]["lastTransitionTime"] == "2026-12-07T12:00:00Z"  # still routed
    assert third["observedGeneration"] == 2
    assert api.model("contract-review-v2")["status"]["plan"] == first["plan"]  # the running plan


def embedding(name: str = "bge-m3", **spec: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"modelPath": "hf://BAAI/bge-m3", "base": "bge-m3", "kind": "embedding",
                              "gpuRequest": "8Gi", "limits": None, "replicas": {"min": 1, "max": 1}}
    fields.update(spec)
    return llmmodel(name, **fields)


async def test_delete_takes_the_model_out_of_routing(api: FakeApi, toolkit: Toolkit) -> None:
    chat, embed = llmmodel(), llmmodel("bge-m3", modelPath="hf://BAAI/bge-m3", base="bge-m3",
                                       kind="embedding", gpuRequest="8Gi", limits=None,
                                       replicas={"min": 1, "max": 1})
    for obj in (chat, embed):
        api.put(obj)
    for obj in (chat, embed):
        await reconcile(api, api.model(obj["metadata"]["name"]), settings=SETTINGS, toolkit=toolkit)
    assert {"contract-review-v2", "bge-m3"} <= set(api.routing()["models"])

    going = api.model("contract-review-v2")
    going["metadata"]["deletionTimestamp"] = "2026-12-07T12:10:00Z"  # kopf's finalizer holds it
    api.put(going)
    verdict = await remove(api, going, settings=SETTINGS, toolkit=toolkit)
    assert verdict.status == "True"
    routing = api.routing()
    assert set(routing["models"]) == {"bge-m3"}
    assert not [c for c in routing["clusters"] if c.startswith("contract-review-v2")]


async def test_deleting_the_last_model_keeps_the_old_routing_and_says_why(
        api: FakeApi, toolkit: Toolkit) -> None:
    """A routing YAML needs a model: with a base of none, the last one cannot leave it."""
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    events: list[tuple[str, str, str]] = []
    verdict = await remove(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                           emit=lambda *e: events.append(e))
    assert (verdict.status, verdict.reason) == ("False", "RoutingInvalid")
    assert events == [("Warning", "RoutingInvalid", verdict.message)]
    assert "the old one keeps serving" in verdict.message
    assert "models is empty: define at least one" in verdict.message
    assert set(api.routing()["models"]) == {"contract-review-v2"}


async def test_a_bad_neighbour_does_not_block_routing(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel("broken", base="llama-2-70b", gpuRequest="1Gi"))
    api.put(llmmodel())
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Routed"]["status"] == "True"
    assert set(api.routing()["models"]) == {"contract-review-v2"}


async def test_without_a_base_routing_configmap_nothing_is_routed(toolkit: Toolkit) -> None:
    api = FakeApi()
    api.put(llmmodel())
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    routed = conditions(status)["Routed"]
    assert (routed["status"], routed["reason"]) == ("False", "BaseConfigMissing")
    assert "llm/llm-sidecar-routing-base has no routing.yaml" in routed["message"]
    assert ("v1", "ConfigMap", NS, "llm-sidecar-routing") not in api.objects
    assert conditions(status)["Planned"]["status"] == "True"


CLASH = "clusters: {contract-review-v2-2k: {endpoints: ['10.0.0.1:8000'], max_context: 2048}}\n"


def set_base(api: FakeApi, text: str) -> None:
    base = api.objects[("v1", "ConfigMap", NS, "llm-sidecar-routing-base")]
    base["data"]["routing.yaml"] = text
    api.put(base)


async def test_a_model_the_base_clashes_with_is_dropped_and_the_others_routed(
        api: FakeApi, toolkit: Toolkit) -> None:
    """One model the merged routing refuses neither freezes the routing of the others nor gets
    GPU Deployments of its own."""
    api.put(llmmodel())
    api.put(embedding())
    set_base(api, BASE + CLASH + "models: {other: {clusters: [contract-review-v2-2k]}}\n")
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e))
    assert [n for _, n in api.applied() if n.startswith("contract-review-v2")] == []
    routed, planned = conditions(status)["Routed"], conditions(status)["Planned"]
    assert (routed["status"], routed["reason"], planned["status"], planned["reason"]) == (
        "False", "RoutingRefused", "False", "RoutingRefused")
    assert routed["message"].startswith(
        "the routing YAML was written without this model: llm/contract-review-v2:1: pool "
        "'contract-review-v2-2k' of 'contract-review-v2' is already a cluster of the routing YAML")
    assert planned["message"] == ("planned, but nothing was applied: the routing YAML cannot take "
                                  "this model (see Routed)")
    assert ("Warning", "RoutingRefused") in [e[:2] for e in events]
    assert set(api.routing()["models"]) == {"other", "bge-m3"}

    status = await reconcile(api, api.model("bge-m3"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Routed"]["reason"] == "RoutingUpdated"
    assert any(kind == "Deployment" and n.startswith("bge-m3-") for kind, n in api.applied())

    set_base(api, BASE)  # the clash goes: the timer retries the refused model
    await refresh(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(api.model("contract-review-v2")["status"])["Planned"]["status"] == "True"
    assert set(api.routing()["models"]) == {"contract-review-v2", "bge-m3"}


async def test_when_nothing_validates_the_old_routing_keeps_serving_and_nothing_is_applied(
        api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    before = api.routing()
    set_base(api, BASE + CLASH)  # a base of no models is no routing YAML on its own
    api.calls.clear()
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e))
    routed = conditions(status)["Routed"]
    assert (routed["status"], routed["reason"]) == ("True", "RoutingNotUpdated")
    assert ("Warning", "RoutingNotUpdated") in [e[:2] for e in events]
    assert routed["message"].startswith("the routing YAML was not updated (the old one keeps serving): "
                                        "llm/contract-review-v2:1: pool 'contract-review-v2-2k' of "
                                        "'contract-review-v2' is already a cluster of the routing YAML")
    assert api.applied() == []
    assert api.routing() == before
    assert api.model("contract-review-v2")["status"]["plan"]["name"] == "contract-review-v2"


async def test_a_deployment_deleted_by_hand_comes_back_on_the_next_timer(
        api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    await api.delete("apps/v1", "Deployment", NS, "contract-review-v2-2k")
    await refresh(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    restored = api.objects[("apps/v1", "Deployment", NS, "contract-review-v2-2k")]
    assert restored["metadata"]["ownerReferences"][0]["name"] == "contract-review-v2"


async def test_an_edited_base_reaches_the_routing_on_the_next_timer(
        api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    api.calls.clear()
    await refresh(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert api.applied() == []  # nothing changed: nothing written
    assert "tenant" not in api.routing()["rate_limits"]

    base = api.objects[("v1", "ConfigMap", NS, "llm-sidecar-routing-base")]
    base["data"]["routing.yaml"] = BASE + "rate_limits: {tenant: {default: {requests: 600/min}}}\n"
    api.put(base)
    await refresh(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert api.routing()["rate_limits"]["tenant"]["default"] == {"requests": "600/min"}
    assert "contract-review-v2" in api.routing()["models"]


async def test_the_role_allows_every_call_the_operator_makes(api: FakeApi, toolkit: Toolkit) -> None:
    """deploy/operator's Role against the requests reconcile, the timer and delete really make."""
    api.put(llmmodel())
    api.put(llmmodel("bge-m3", modelPath="hf://BAAI/bge-m3", base="bge-m3", kind="embedding",
                     gpuRequest="8Gi", limits=None))
    for name in ("contract-review-v2", "bge-m3"):
        await reconcile(api, api.model(name), settings=SETTINGS, toolkit=toolkit)
    await reconcile(api, api.model("bge-m3"), settings=SETTINGS, toolkit=toolkit)
    await refresh_pools_ready(api, api.model("bge-m3"), settings=SETTINGS, toolkit=toolkit)
    await refresh(api, api.model("bge-m3"), settings=SETTINGS, toolkit=toolkit)
    await reconcile(api, edited(api, contexts=[2048]), settings=SETTINGS, toolkit=toolkit)  # prunes
    await remove(api, api.model("bge-m3"), settings=SETTINGS, toolkit=toolkit)
    assert {verb for verb, *_ in api.calls} == {"create", "patch", "get", "list", "delete"}
    assert {kind for verb, _, kind, _ in api.calls if verb == "delete"} == POOL_KINDS

    def allowed(verb: str, api_version: str, kind: str, name: str) -> bool:
        group = api_version.rpartition("/")[0]
        base_kind, _, sub = kind.partition("/")
        plural = PLURALS[(api_version, base_kind)] + (f"/{sub.lower()}" if sub else "")
        return any(group in r["apiGroups"] and plural in r["resources"] and verb in r["verbs"]
                   and (not name or "resourceNames" not in r or name in r["resourceNames"])
                   for r in rules())

    assert [c for c in api.calls if not allowed(*c)] == []


def test_resource_paths_are_the_plural_rest_paths() -> None:
    assert resource_path("v1", "ConfigMap", "llm", "r") == "/api/v1/namespaces/llm/configmaps/r"
    assert resource_path("apps/v1", "Deployment", "llm") == "/apis/apps/v1/namespaces/llm/deployments"
    assert resource_path("llm-sidecar.dev/v1alpha1", "LLMModel", "a b", "x") == (
        "/apis/llm-sidecar.dev/v1alpha1/namespaces/a%20b/llmmodels/x")
    with pytest.raises(KubeApiError, match="does not handle Secret of v1"):
        resource_path("v1", "Secret", "llm", "x")


async def test_the_in_cluster_client_sends_server_side_apply(tmp_path: pathlib.Path) -> None:
    """The requests :class:`InClusterApi` makes, seen by a plain HTTP server standing in for the
    API server (TLS and the real server are not exercised)."""
    seen: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append({"method": request.method, "path": request.path, "query": dict(request.query),
                     "type": request.headers.get("Content-Type"),
                     "auth": request.headers.get("Authorization"),
                     "body": json.loads(await request.text() or "null")})
        if request.path.endswith("/missing") or request.path.endswith("/gone"):
            return web.json_response({"kind": "Status", "message": "not found"}, status=404)
        if request.path.endswith("/forbidden"):
            return web.json_response({"kind": "Status", "message": "configmaps is forbidden"},
                                     status=403)
        return web.json_response({"items": [{"metadata": {"name": "m"}}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    (tmp_path / "token").write_text("t0ken\n")
    client = InClusterApi(base_url=f"http://127.0.0.1:{port}/", account_dir=str(tmp_path))
    try:
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "r", "namespace": "llm"}, "data": {"k": "v"}}
        await client.apply(cm)
        assert await client.get("v1", "ConfigMap", "llm", "missing") is None
        assert await client.list_llmmodels("llm") == [{"metadata": {"name": "m"}}]
        await client.patch_status("llm", "m", {"observedGeneration": 2})
        assert await client.list_labelled("apps/v1", "Deployment", "llm", "llm-sidecar.dev/model=m") == [
            {"metadata": {"name": "m"}}]
        await client.delete("apps/v1", "Deployment", "llm", "m-4k")
        await client.delete("apps/v1", "Deployment", "llm", "gone")  # already deleted: no error
        with pytest.raises(KubeApiError, match="403: configmaps is forbidden"):
            await client.get("v1", "ConfigMap", "llm", "forbidden")
    finally:
        await client.close()
        await runner.cleanup()
    assert seen[0] == {"method": "PATCH", "path": "/api/v1/namespaces/llm/configmaps/r",
                       "query": {"fieldManager": "llm-sidecar", "force": "true"},
                       "type": "application/apply-patch+yaml", "auth": "Bearer t0ken", "body": cm}
    assert seen[2]["path"] == "/apis/llm-sidecar.dev/v1alpha1/namespaces/llm/llmmodels"
    assert (seen[3]["path"], seen[3]["type"], seen[3]["body"]) == (
        "/apis/llm-sidecar.dev/v1alpha1/namespaces/llm/llmmodels/m/status",
        "application/merge-patch+json", {"status": {"observedGeneration": 2}})
    assert (seen[4]["method"], seen[4]["path"], seen[4]["query"]) == (
        "GET", "/apis/apps/v1/namespaces/llm/deployments", {"labelSelector": "llm-sidecar.dev/model=m"})
    assert (seen[5]["method"], seen[5]["path"], seen[5]["query"]) == (
        "DELETE", "/apis/apps/v1/namespaces/llm/deployments/m-4k", {"propagationPolicy": "Background"})
    assert seen[6]["method"] == "DELETE"


def test_the_client_refuses_to_start_outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeApiError, match="KUBERNETES_SERVICE_HOST is not set"):
        InClusterApi()


def test_operator_flags(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="llm-sidecar operator")
    add_operator_arguments(parser)
    args = parser.parse_args(["--standalone", "--liveness", "0.0.0.0:8080"])
    assert (args.standalone, args.liveness) == (True, "http://0.0.0.0:8080/healthz")
    assert (args.allow_gateway_limits, args.allow_host_paths) == (False, False)
    assert parser.parse_args(["--allow-gateway-limits"]).allow_gateway_limits is True
    assert (args.routing_configmap, args.base_configmap) == (
        "llm-sidecar-routing", "llm-sidecar-routing-base")
    with pytest.raises(SystemExit):
        parser.parse_args(["--liveness", "8080"])
    assert "give host:port, like 0.0.0.0:8080" in capsys.readouterr().err
    (tmp_path / "namespace").write_text("team-a\n")
    assert pod_namespace(str(tmp_path / "namespace")) == "team-a"
    assert pod_namespace(str(tmp_path / "absent")) == "default"


class BrokenApi(FakeApi):
    async def list_llmmodels(self, namespace: str) -> list[dict[str, Any]]:
        raise KubeApiError(503, "etcdserver: leader changed")


def kopf_event_queue() -> asyncio.Queue[Any]:
    """kopf's event queue, set up as a running operator sets it (kopf has no public test hook
    for ``kopf.event`` outside a running operator); the test's task keeps its own context."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    posting.settings_var.set(kopf.OperatorSettings())
    posting.event_queue_var.set(queue)
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    return queue


def body(obj: dict[str, Any]) -> kopf.Body:
    return kopf.Body(cast(kopf.RawBody, obj))


async def test_the_kopf_handlers_post_events_and_retry_only_api_failures(
        api: FakeApi, toolkit: Toolkit) -> None:
    kopf_events = kopf_event_queue()
    handlers = register_handlers(kopf.OperatorRegistry(), api, SETTINGS, toolkit)
    bad = llmmodel(gpuRequest="1Gi", base="llama-2-70b")
    api.put(bad)
    await handlers.on_change(body=body(bad), logger=None)
    posted = kopf_events.get_nowait()
    assert (posted.type, posted.reason, posted.ref["name"]) == ("Warning", "InvalidSpec",
                                                                "contract-review-v2")
    assert "fits no GPU" in posted.message
    assert conditions(api.model("contract-review-v2")["status"])["Planned"]["status"] == "False"

    broken = register_handlers(kopf.OperatorRegistry(), BrokenApi(), SETTINGS, toolkit)
    for handler in (broken.on_change, broken.on_delete):
        with pytest.raises(kopf.TemporaryError, match="503: etcdserver: leader changed"):
            await handler(body=body(llmmodel()))


async def test_the_timer_handler_marks_the_pools_ready(api: FakeApi, toolkit: Toolkit) -> None:
    kopf_events = kopf_event_queue()
    handlers = register_handlers(kopf.OperatorRegistry(), api, SETTINGS, toolkit)
    api.put(llmmodel())
    await handlers.on_change(body=body(api.model("contract-review-v2")))
    api.set_ready(1)
    await handlers.on_timer(body=body(api.model("contract-review-v2")))
    assert conditions(api.model("contract-review-v2")["status"])["PoolsReady"]["status"] == "True"
    reasons = []
    while not kopf_events.empty():
        reasons.append(kopf_events.get_nowait().reason)
    assert reasons[-1] == "PodsReady"


def test_models_that_plan_alone_but_not_together_are_reported_not_applied() -> None:
    real = default_toolkit(SETTINGS)

    def alone_only(models: Sequence[LoadedModel]) -> list[ModelPlan]:
        if len(models) > 1:
            raise ConfigError.at(f"{NS}/other", 1, "pool names clash")
        return real.plan(models)

    planned = plan_namespace([llmmodel(), llmmodel("other")], NS,
                             Toolkit(alone_only, real.objects, real.merge))
    assert (planned.plans, planned.errors) == ({}, {})
    assert str(planned.joint) == "llm/other:1: pool names clash"


def test_the_operator_command_fails_clearly_outside_a_cluster(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_operator_arguments(parser)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert operator_command(parser.parse_args(["--namespace", NS])) == 1
    assert capsys.readouterr().err == (
        "llm-sidecar operator: Kubernetes API: KUBERNETES_SERVICE_HOST is not set: "
        "run the operator in a pod\n")
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("gpus:\n  - {name: X, memory: lots}\n")
    with pytest.raises(ConfigError, match=r"gpus.yaml:2: gpus.0.memory: 'lots' is not a size"):
        operator_command(parser.parse_args(["--gpus", str(gpus)]))  # the CLI prints it, exit 1


def crashing_on(real: Toolkit, bad: str) -> Toolkit:
    """The real toolkit, but planning ``bad`` divides by zero (as a hostile architecture could)."""
    def plan(models: Sequence[LoadedModel]) -> list[ModelPlan]:
        if any(m.name == bad for m in models):
            raise ZeroDivisionError("division by zero")
        return real.plan(models)
    return Toolkit(plan, real.objects, real.merge)


async def test_a_model_the_planner_crashes_on_does_not_stop_the_others(
        api: FakeApi, toolkit: Toolkit, caplog: pytest.LogCaptureFixture) -> None:
    tools = crashing_on(toolkit, "hostile")
    api.put(llmmodel("hostile"))
    api.put(embedding())
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, api.model("bge-m3"), settings=SETTINGS, toolkit=tools)
    assert conditions(status)["Planned"]["status"] == "True"
    assert conditions(status)["Routed"]["reason"] == "RoutingUpdated"
    assert set(api.routing()["models"]) == {"bge-m3"}
    assert any(kind == "Deployment" and n.startswith("bge-m3-") for kind, n in api.applied())

    status = await reconcile(api, api.model("hostile"), settings=SETTINGS, toolkit=tools,
                             emit=lambda *e: events.append(e))
    planned = conditions(status)["Planned"]
    assert (planned["status"], planned["reason"]) == ("False", "PlanningFailed")
    assert planned["message"] == ("llm/hostile:1: planning failed: ZeroDivisionError: division by zero "
                                  "(an operator bug: its log has the details)")
    assert [e[:2] for e in events] == [("Warning", "PlanningFailed")]
    assert not [n for _, n in api.applied() if n.startswith("hostile")]
    assert set(api.routing()["models"]) == {"bge-m3"}
    logged = [r for r in caplog.records if "llm/hostile" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback goes to the log only


async def test_a_joint_planning_crash_still_writes_each_status(api: FakeApi, toolkit: Toolkit) -> None:
    def alone_only(models: Sequence[LoadedModel]) -> list[ModelPlan]:
        if len(models) > 1:
            raise ZeroDivisionError("division by zero")
        return toolkit.plan(models)

    tools = Toolkit(alone_only, toolkit.objects, toolkit.merge)
    api.put(llmmodel())
    api.put(embedding())
    for name in ("contract-review-v2", "bge-m3"):
        status = await reconcile(api, api.model(name), settings=SETTINGS, toolkit=tools)
        planned = conditions(status)["Planned"]
        assert (planned["status"], planned["reason"]) == ("False", "PlanningFailed")
        assert planned["message"].startswith(
            "llm:1: planning bge-m3, contract-review-v2 together failed: ZeroDivisionError")
    assert api.applied() == []


async def test_an_object_made_by_hand_is_not_taken_over(api: FakeApi, toolkit: Toolkit) -> None:
    """A Service someone made with the name of a pool stays theirs: the model applies nothing
    (so deleting it would not garbage-collect their Service) and says which object is in the way."""
    hand_made = {"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": "contract-review-v2-2k", "namespace": NS},
                 "spec": {"selector": {"app": "mine"}, "ports": [{"port": 80}]}}
    api.put(copy.deepcopy(hand_made))
    api.put(llmmodel())
    api.put(embedding())
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e))
    planned = conditions(status)["Planned"]
    assert (planned["status"], planned["reason"]) == ("False", "ObjectNotOwned")
    assert planned["message"] == (
        "Service llm/contract-review-v2-2k already exists and this LLMModel does not own it: nothing "
        "of the model was applied (delete or rename that object, or rename the model)")
    assert events[0][:2] == ("Warning", "ObjectNotOwned")
    assert [n for _, n in api.applied() if n.startswith("contract-review-v2")] == []
    kept = api.objects[("v1", "Service", NS, "contract-review-v2-2k")]
    assert "ownerReferences" not in kept["metadata"] and kept["spec"] == hand_made["spec"]
    assert set(api.routing()["models"]) == {"bge-m3"}  # not routed to their Service either
    assert conditions(status)["Routed"]["status"] == "False"

    await api.delete("v1", "Service", NS, "contract-review-v2-2k")  # out of the way: the timer applies
    await refresh(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(api.model("contract-review-v2")["status"])["Planned"]["status"] == "True"
    taken = api.objects[("v1", "Service", NS, "contract-review-v2-2k")]
    assert taken["metadata"]["ownerReferences"][0]["uid"] == "uid-contract-review-v2"
    assert "contract-review-v2" in api.routing()["models"]


async def test_another_models_object_is_not_taken_over(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    rule = next(o for (_, kind, _, _), o in api.objects.items() if kind == "PrometheusRule")
    rule["metadata"]["ownerReferences"][0]["uid"] = "uid-someone-else"
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Planned"]["reason"] == "ObjectNotOwned"
    assert f"PrometheusRule llm/{rule['metadata']['name']} already exists" in (
        conditions(status)["Planned"]["message"])


@pytest.mark.parametrize("key", ["tenant", "api_key"])
async def test_gateway_wide_limits_are_refused_unless_the_operator_allows_them(
        api: FakeApi, toolkit: Toolkit, key: str) -> None:
    obj = llmmodel(limits={key: {"default": {"requests": "1/min"}}})
    api.put(obj)
    status = await reconcile(api, obj, settings=SETTINGS, toolkit=toolkit)
    assert api.applied() == []
    planned = conditions(status)["Planned"]
    assert (planned["status"], planned["reason"]) == ("False", "InvalidSpec")
    assert planned["message"] == (
        f"llm/contract-review-v2:1: limits.{key} changes the gateway's {key} limits of every model: "
        "this operator refuses it (start it with --allow-gateway-limits to allow it); limits.model "
        "limits this model alone")

    allowing = OperatorSettings(namespace=NS, allow_gateway_limits=True)
    status = await reconcile(api, api.model("contract-review-v2"), settings=allowing,
                             toolkit=default_toolkit(allowing))
    assert conditions(status)["Planned"]["status"] == "True"
    assert api.routing()["rate_limits"][key]["default"] == {"requests": "1/min"}


async def test_of_two_models_that_cannot_merge_the_older_keeps_its_routing(api: FakeApi) -> None:
    allowing = OperatorSettings(namespace=NS, allow_gateway_limits=True)
    tools = default_toolkit(allowing)
    for name, created, rate in (("older", "2026-12-01T00:00:00Z", "100/min"),
                                ("newer", "2026-12-02T00:00:00Z", "200/min")):
        obj = llmmodel(name, limits={"tenant": {"default": {"requests": rate}}})
        obj["metadata"]["creationTimestamp"] = created
        api.put(obj)
    status = await reconcile(api, api.model("newer"), settings=allowing, toolkit=tools)
    routed = conditions(status)["Routed"]
    assert (routed["status"], routed["reason"]) == ("False", "RoutingRefused")
    assert "llm/newer:" in routed["message"]
    assert not [n for _, n in api.applied() if n.startswith("newer")]
    status = await reconcile(api, api.model("older"), settings=allowing, toolkit=tools)
    assert conditions(status)["Routed"]["reason"] == "RoutingUpdated"
    assert set(api.routing()["models"]) == {"older"}
    assert api.routing()["rate_limits"]["tenant"]["default"] == {"requests": "100/min"}


async def test_a_merge_crash_refuses_only_the_model_it_crashes_on(api: FakeApi, toolkit: Toolkit) -> None:
    def merge(base: str, source: str, plans: Sequence[ModelPlan], namespace: str) -> str:
        if any(p.name == "hostile" for p in plans):
            raise ZeroDivisionError("division by zero")
        return toolkit.merge(base, source, plans, namespace)

    tools = Toolkit(toolkit.plan, toolkit.objects, merge)
    api.put(llmmodel("hostile"))
    status = await reconcile(api, api.model("hostile"), settings=SETTINGS, toolkit=tools)
    routed = conditions(status)["Routed"]
    assert (routed["status"], routed["reason"]) == ("False", "RoutingRefused")
    assert routed["message"].startswith("the routing YAML was not updated (the old one keeps serving): "
                                        "llm:1: merging hostile into the routing failed: ZeroDivisionError")
    assert ("v1", "ConfigMap", NS, "llm-sidecar-routing") not in api.objects  # no model merges: no write
    assert api.applied() == []

    api.put(embedding())
    status = await reconcile(api, api.model("bge-m3"), settings=SETTINGS, toolkit=tools)
    assert conditions(status)["Routed"]["reason"] == "RoutingUpdated"
    assert set(api.routing()["models"]) == {"bge-m3"}
    status = await reconcile(api, api.model("hostile"), settings=SETTINGS, toolkit=tools)
    assert conditions(status)["Routed"]["message"] == (
        "the routing YAML was written without this model: llm:1: merging hostile into the routing "
        "failed: ZeroDivisionError: division by zero (an operator bug: its log has the details)")


async def test_a_model_and_its_declared_canary_are_routed_together_when_another_is_dropped(
        api: FakeApi, toolkit: Toolkit) -> None:
    """Merged one at a time, a stable model alone would fail for want of its declared canary:
    the two go in together, and only the clashing model is dropped."""
    api.put(llmmodel(canary={"model": "contract-review-v3", "percent": 5}))
    api.put(llmmodel("contract-review-v3", canaryOf="contract-review-v2", limits=None))
    api.put(llmmodel("clashing"))
    set_base(api, BASE + "clusters: {clashing-2k: {endpoints: ['10.0.0.1:8000'], max_context: 2048}}\n"
             "models: {other: {clusters: [clashing-2k]}}\n")
    status = await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Routed"]["reason"] == "RoutingUpdated"
    routing = api.routing()
    assert set(routing["models"]) == {"other", "contract-review-v2"}
    assert routing["models"]["contract-review-v2"]["canary"]["model"] == "contract-review-v3"
    status = await reconcile(api, api.model("clashing"), settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Routed"]["reason"] == "RoutingRefused"


def edited(api: FakeApi, name: str = "contract-review-v2", **spec: Any) -> dict[str, Any]:
    """``kubectl edit llmmodel NAME``: the stored model with ``spec`` changed, generation bumped."""
    obj = api.model(name)
    obj["spec"].update(spec)
    obj["metadata"]["generation"] += 1
    api.put(obj)
    return api.model(name)


def kinds_named(api: FakeApi, name: str) -> set[str]:
    return {kind for (_, kind, _, n) in api.objects if n == name}


async def test_a_dropped_context_is_routed_away_then_its_pool_deleted(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel(contexts=[2048, 4096]))
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert kinds_named(api, "contract-review-v2-4k") == POOL_KINDS
    assert "contract-review-v2-4k" in api.routing()["models"]["contract-review-v2"]["clusters"]

    api.calls.clear()
    events: list[tuple[str, str, str]] = []
    status = await reconcile(api, edited(api, contexts=[2048]), settings=SETTINGS, toolkit=toolkit,
                             emit=lambda *e: events.append(e))
    assert kinds_named(api, "contract-review-v2-4k") == set()
    assert kinds_named(api, "contract-review-v2-2k") == POOL_KINDS
    assert ("monitoring.coreos.com/v1", "PrometheusRule", NS, "contract-review-v2-slo") in api.objects
    assert "contract-review-v2-4k" not in yaml.safe_dump(api.routing())
    assert list(api.routing()["models"]["contract-review-v2"]["clusters"]) == ["contract-review-v2-2k"]
    deletes = [i for i, call in enumerate(api.calls) if call[0] == "delete"]
    routing_write = max(i for i, (verb, _, kind, name) in enumerate(api.calls) if verb in ("create", "patch")
                        and (kind, name) == ("ConfigMap", "llm-sidecar-routing"))
    assert len(deletes) == 6 and routing_write < deletes[0]  # no route to a deleted pool, ever
    assert ("Normal", "Pruned",
            "deleted 6 object(s) the spec no longer declares: HorizontalPodAutoscaler/contract-review-v2-4k, "
            "Deployment/contract-review-v2-4k, InferencePool/contract-review-v2-4k, "
            "Service/contract-review-v2-4k, PodMonitor/contract-review-v2-4k, "
            "NetworkPolicy/contract-review-v2-4k") in events
    assert conditions(status)["Planned"]["message"] == "1 pool(s), 7 object(s) applied"

    api.calls.clear()
    events.clear()
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit,
                    emit=lambda *e: events.append(e))
    assert [c for c in api.calls if c[0] == "delete"] == []  # nothing left to prune: no event
    assert "Pruned" not in [reason for _, reason, _ in events]


async def test_lowering_max_replicas_to_min_deletes_the_autoscalers(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    hpas = {n for (_, kind, _, n) in api.objects if kind == "HorizontalPodAutoscaler"}
    assert hpas == {"contract-review-v2-2k", "contract-review-v2-4k"}
    await reconcile(api, edited(api, replicas={"min": 1, "max": 1}), settings=SETTINGS, toolkit=toolkit)
    assert [k for k in api.objects if k[1] == "HorizontalPodAutoscaler"] == []
    assert {n for (_, kind, _, n) in api.objects if kind == "Deployment"} == hpas  # the pools stay


def replicas(api: FakeApi) -> dict[str, int | None]:
    return {n: o["spec"].get("replicas") for (_, kind, _, n), o in api.objects.items()
            if kind == "Deployment"}


async def test_a_pool_the_autoscaler_takes_over_keeps_its_pods_until_it_does(
        api: FakeApi, toolkit: Toolkit) -> None:
    """min = max = 3: the operator sizes the Deployments. Raising max hands ``replicas`` over
    to the HPA: without the handover, server-side apply would drop it to 1 until the HPA's
    next sync, two of three pods gone."""
    api.put(llmmodel(replicas={"min": 3, "max": 3}))
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    pools = {"contract-review-v2-2k": 3, "contract-review-v2-4k": 3}
    assert replicas(api) == pools
    await reconcile(api, edited(api, replicas={"min": 3, "max": 6}), settings=SETTINGS, toolkit=toolkit)
    assert replicas(api) == pools  # still 3 each, the HPA's to change from now on
    assert sorted(n for m, _, n in api.managers if m == HANDOVER_MANAGER) == sorted(pools)
    assert {n for (_, kind, _, n) in api.objects if kind == "HorizontalPodAutoscaler"} == set(pools)
    # The operator no longer owns them: a later reconcile hands nothing over again.
    api.managers.clear()
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert [m for m, _, _ in api.managers if m == HANDOVER_MANAGER] == []
    assert replicas(api) == pools


async def test_a_removed_inline_canary_loses_its_pool(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel(canary={"model": "contract-review-v3", "percent": 5,
                             "modelPath": "hf://meta-llama/Llama-2-13b-chat-hf"}))
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    assert "Deployment" in kinds_named(api, "contract-review-v2-canary")
    await reconcile(api, edited(api, canary=None), settings=SETTINGS, toolkit=toolkit)
    assert kinds_named(api, "contract-review-v2-canary") == set()
    assert "contract-review-v2-canary" not in yaml.safe_dump(api.routing())
    assert kinds_named(api, "contract-review-v2-4k") == POOL_KINDS


async def test_pruning_never_deletes_what_this_model_does_not_control(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    label = {"llm-sidecar.dev/model": "contract-review-v2"}

    def stray(kind: str, api_version: str, name: str, refs: list[dict[str, Any]] | None) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": dict(label)}
        if refs is not None:
            meta["ownerReferences"] = refs
        api.put({"apiVersion": api_version, "kind": kind, "metadata": meta, "spec": {}})

    ref = {"apiVersion": "llm-sidecar.dev/v1alpha1", "kind": "LLMModel", "name": "contract-review-v2"}
    stray("Deployment", "apps/v1", "another-models", [{**ref, "uid": "uid-other", "controller": True}])
    stray("Service", "v1", "hand-made", None)  # the label copied by hand
    stray("NetworkPolicy", "networking.k8s.io/v1", "not-controller",
          [{**ref, "uid": "uid-contract-review-v2", "controller": False}])
    strays = [k for k in api.objects if k[3] in ("another-models", "hand-made", "not-controller")]
    await reconcile(api, edited(api, contexts=[2048]), settings=SETTINGS, toolkit=toolkit)
    assert kinds_named(api, "contract-review-v2-4k") == set()  # its own dropped objects do go
    assert [k for k in strays if k not in api.objects] == []


async def test_a_spec_that_fails_to_plan_prunes_nothing(api: FakeApi, toolkit: Toolkit) -> None:
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    before = set(api.objects) - {k for k in api.objects if k[1] == "LLMModel"}
    api.calls.clear()
    status = await reconcile(api, edited(api, base="llama-2-70b", gpuRequest="1Gi", contexts=[2048]),
                             settings=SETTINGS, toolkit=toolkit)
    assert conditions(status)["Planned"]["reason"] == "InvalidSpec"
    assert [c for c in api.calls if c[0] == "delete"] == []
    assert before <= set(api.objects)


class FailingDeleteApi(FakeApi):
    failing = True

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        if self.failing:
            self.calls.append(("delete", api_version, kind, name))
            raise KubeApiError(500, "etcdserver: request timed out")
        await super().delete(api_version, kind, namespace, name)


async def test_a_failed_delete_is_retried_as_any_api_failure(toolkit: Toolkit) -> None:
    api = FailingDeleteApi()
    api.put({"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "llm-sidecar-routing-base", "namespace": NS},
             "data": {"routing.yaml": BASE}})
    api.put(llmmodel())
    await reconcile(api, api.model("contract-review-v2"), settings=SETTINGS, toolkit=toolkit)
    kopf_events = kopf_event_queue()
    handlers = register_handlers(kopf.OperatorRegistry(), api, SETTINGS, toolkit)
    with pytest.raises(kopf.TemporaryError, match="500: etcdserver: request timed out"):
        await handlers.on_change(body=body(edited(api, contexts=[2048])))
    # the routing already left the 4k pool; its objects wait for the retry
    assert list(api.routing()["models"]["contract-review-v2"]["clusters"]) == ["contract-review-v2-2k"]
    assert "Deployment" in kinds_named(api, "contract-review-v2-4k")
    assert kinds_named(api, "contract-review-v2-2k") == POOL_KINDS

    api.failing = False  # kopf's retry
    await handlers.on_change(body=body(api.model("contract-review-v2")))
    assert kinds_named(api, "contract-review-v2-4k") == set()
    posted = []
    while not kopf_events.empty():
        posted.append(kopf_events.get_nowait())
    pruned = [e for e in posted if e.reason == "Pruned"]
    assert [(e.type, e.ref["name"]) for e in pruned] == [("Normal", "contract-review-v2")]
    assert "Deployment/contract-review-v2-4k" in pruned[0].message
    stored = api.model("contract-review-v2")["status"]
    assert (stored["observedGeneration"], conditions(stored)["Planned"]["status"]) == (2, "True")
