"""What ``up --models`` serves for a folder of LLMModels, decided without starting anything: the
routing YAML (the base merged with the plans), each pool's simulator settings and port, which
pods start and stop between two folders, and the make-before-break routing in between.
:mod:`llm_sidecar.models_up` carries these decisions out."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llm_sidecar.up import local_url
from routing.errors import ConfigError
from routing.loader import validate
from routing.schema import RoutingConfig
from routing.units import parse_hostport
from routing.yamlsrc import Located, read_yaml
from sidecar_runtime.process.procs import sidecar_command

if TYPE_CHECKING:
    from llmmodel.plans import ModelPlan

LOOPBACK = "127.0.0.1"
NO_MODELS = "llm-sidecar-no-models"
"""The placeholder pool and model of a folder with no model: its pod address is never
listened on (port 9, discard), and a context of 1 token fits no request."""
BUILTIN_BASE: dict[str, Any] = {
    "version": 1,
    "envoy": {"listen": f"{LOOPBACK}:10000", "admin": f"{LOOPBACK}:9901"},
    "services": {"extproc": f"{LOOPBACK}:50051", "ratelimit": f"{LOOPBACK}:50052"},
    "auth": {"required": False},
    "rate_limits": {"on_backend_error": "allow"},
}
"""The base without ``--config``: the ports of ``llm-sidecar up``, open mode, no limits of its
own (the models' ``limits`` add theirs)."""


def base_document(path: str | None) -> dict[str, Any]:
    """The base routing document: ``path``'s (it may have no clusters or models), else the
    built-in one; always with ``envoy.dynamic_pools`` and a ``rate_limits`` section."""
    if path is None:
        doc = copy.deepcopy(BUILTIN_BASE)
    else:
        located = read_yaml(path)
        data = located.data if located.data is not None else {}
        if not isinstance(data, dict):
            raise ConfigError([located.problem((), "the file must be a mapping with version: 1")])
        if not isinstance(data.get("envoy", {}), dict):
            raise ConfigError([located.problem(("envoy",), "envoy: must be a mapping")])
        doc = copy.deepcopy(data)
    doc.setdefault("version", 1)
    doc["envoy"] = {**(doc.get("envoy") or {}), "dynamic_pools": True}
    if doc.get("rate_limits") is None:
        doc["rate_limits"] = {}
    return doc


def with_placeholder(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the never-routable :data:`NO_MODELS` pool when it has no model (the routing
    YAML needs one)."""
    if doc.get("models"):
        return doc
    out = copy.deepcopy(doc)
    out["clusters"] = {**(out.get("clusters") or {}),
                       NO_MODELS: {"endpoints": [f"{LOOPBACK}:9"], "max_context": 1}}
    out["models"] = {NO_MODELS: {"clusters": [NO_MODELS], "default_max_tokens": 1}}
    return out


def sim_settings(cluster: Mapping[str, Any]) -> str:
    """What a pool's simulators are started with, as one comparable text."""
    return json.dumps({"max_context": cluster.get("max_context"),
                       "simulate": cluster.get("simulate")}, sort_keys=True)


Ports = dict[str, tuple[str, int]]
"""Pool name → (its simulator settings, the port its pod listens on)."""


def assign_ports(settings: Mapping[str, str], previous: Mapping[str, tuple[str, int]],
                 take: Callable[[], int]) -> Ports:
    """A port for each pool of ``settings``: the one it had while its settings are the same;
    ``take()`` for a new pool, or one whose settings changed (its new pod starts beside the
    old one, which stops once nothing is routed to it)."""
    used = {port for _, port in previous.values()}
    out: Ports = {}
    for name in sorted(settings):
        held = previous.get(name)
        if held is not None and held[0] == settings[name]:
            out[name] = held
            continue
        port = take()
        while port in used:
            port = take()
        used.add(port)
        out[name] = (settings[name], port)
    return out


@dataclass(frozen=True)
class Pod:
    """One simulated pod: an ``llm-sidecar sim`` on a local address."""

    cluster: str
    endpoint: str
    max_context: int
    flags: tuple[str, ...]

    def command(self) -> list[str]:
        host, port = parse_hostport(self.endpoint)
        return sidecar_command("sim", "--host", host, "--port", str(port), "--name", self.cluster,
                               "--max-model-len", str(self.max_context), *self.flags)

    @property
    def health_url(self) -> str:
        host, port = parse_hostport(self.endpoint)
        return local_url(host, port, "/health")


def pods_of(config: RoutingConfig) -> dict[str, Pod]:
    """Endpoint → pod, for every endpoint of every ``simulate:`` cluster."""
    out: dict[str, Pod] = {}
    for name, spec in config.clusters.items():
        sim = spec.simulator
        if sim is not None:
            for endpoint in spec.endpoints:
                out[endpoint] = Pod(name, endpoint, spec.max_context, tuple(sim.sim_flags()))
    return out


@dataclass(frozen=True)
class PodChange:
    start: tuple[Pod, ...]
    stop: tuple[Pod, ...]


def pod_changes(running: Mapping[str, Pod], wanted: Mapping[str, Pod]) -> PodChange:
    """Pods to start (new, or changed at their address) and to stop (gone, or changed)."""
    start = tuple(pod for endpoint, pod in sorted(wanted.items()) if running.get(endpoint) != pod)
    stop = tuple(pod for endpoint, pod in sorted(running.items()) if wanted.get(endpoint) != pod)
    return PodChange(start, stop)


def make_before_break(old: RoutingConfig, new: RoutingConfig) -> RoutingConfig:
    """What Envoy serves while a change is applied: every pool of ``new`` and of ``old``, a pool
    of both with the pods of both (``new``'s first). Envoy's files only: never validated as a
    routing YAML."""
    clusters = {name: spec for name, spec in old.clusters.items() if name not in new.clusters}
    for name, spec in new.clusters.items():
        before = old.clusters.get(name)
        if before is None:
            clusters[name] = spec
            continue
        gone = [e for e in before.endpoints if e not in spec.endpoints]
        clusters[name] = spec.model_copy(update={"endpoints": [*spec.endpoints, *gone]})
    return new.model_copy(update={"clusters": clusters})


@dataclass
class Served:
    """The set of models the gateway serves now."""

    doc: dict[str, Any]
    config: RoutingConfig
    ports: Ports = field(default_factory=dict)
    models: tuple[str, ...] = ()


def models_line(old: Served | None, new: Served) -> str:
    """What a change did: ``models: +added -removed ~changed kept`` (pools or entry changed)."""
    before = old.models if old is not None else ()

    def pools(served: Served, model: str) -> list[Any]:
        entry = served.doc["models"][model]
        return [entry, *(served.doc["clusters"].get(c) for c in entry.get("clusters", []))]

    words = [f"+{n}" for n in new.models if n not in before]
    words += [f"-{n}" for n in before if n not in new.models]
    for name in new.models:
        if old is not None and name in before:
            words.append(name if pools(old, name) == pools(new, name) else f"~{name}")
    return f"models: {' '.join(words) or 'none'}"


def plan_folder(folder: str, gpus: str | None) -> list[ModelPlan]:
    """Every LLMModel in ``folder``, planned; raises :class:`ConfigError`."""
    from llmmodel.catalog import load_gpus
    from llmmodel.planner import plan_models
    from llmmodel.spec import load_models
    return plan_models(load_models([folder]), load_gpus(gpus))


def build(base: dict[str, Any], plans: Sequence[ModelPlan], previous: Mapping[str, tuple[str, int]],
          take: Callable[[], int], source: str) -> Served:
    """The routing document for ``plans`` on ``base``, its pools on ports (:func:`assign_ports`);
    raises :class:`ConfigError` (a clash with the base, or a merged document that is not
    valid, named at ``source``)."""
    from llmmodel.routing_merge import merge_routing
    probe = merge_routing(base, plans, endpoints=lambda pool: [f"{LOOPBACK}:1"], simulate=True)
    pools = {pool.name for plan in plans for pool in plan.pools}
    ports = assign_ports({name: sim_settings(probe["clusters"][name]) for name in pools},
                         previous, take)
    doc = with_placeholder(merge_routing(
        base, plans, endpoints=lambda pool: [f"{LOOPBACK}:{ports[pool.name][1]}"], simulate=True))
    config = validate(Located(source, doc, {}))
    return Served(doc, config, ports, tuple(sorted(p.name for p in plans)))
