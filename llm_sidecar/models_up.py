"""``llm-sidecar up --models DIR``: the local gateway serving every LLMModel in DIR on simulated
pods sized by its plan, following DIR while it runs.

The base routing YAML (``--config``, else :data:`BUILTIN_BASE`) is merged with the plans of the
models (:func:`llmmodel.routing_merge.merge_routing`) and served with ``envoy.dynamic_pools``:
Envoy reads the pools from files it watches, so a model added, changed or removed never
restarts Envoy. A change is applied make-before-break:

1. the new pods (simulators) start, and are waited for;
2. Envoy gets every old and new pool and pod (the xDS files), and is waited for (admin);
3. the routing YAML is replaced: extproc and ratelimit reload it live (waited for on their
   ``*_config_reloads_total``); from here requests go to the new pools only;
4. Envoy's files lose what is gone, then the pods that are gone stop.

A pool keeps its port while its simulator settings stay the same; a pool whose settings change
gets new pods on a new port beside the old ones (steps 1-4 replace them without a gap).

A folder that does not load (a bad file, a model that does not fit, a name clash) is reported
as ``FILE:LINE: message`` lines and the models served before stay served. With no model at
all, a placeholder pool that never answers keeps the routing YAML valid: every model name
gets 404 ``model_not_found`` until a file appears. The base always has ``rate_limits`` (empty
by default), so ratelimit always runs and a model's ``limits`` apply as soon as it appears.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from routing.errors import ConfigError
from routing.loader import validate
from routing.schema import RoutingConfig
from routing.units import parse_hostport
from routing.yamlsrc import Located, read_yaml
from sidecar_runtime.process.procs import Child, free_port, sidecar_command

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
        return f"http://{LOOPBACK if host in ('0.0.0.0', '') else host}:{port}/health"


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


def say(text: str) -> None:
    print(f"llm-sidecar up: {text}", file=sys.stderr, flush=True)


def admin_get(admin: str, path: str) -> str:
    host, port = parse_hostport(admin)
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as resp:
        text: str = resp.read().decode("utf-8", "replace")
    return text


def envoy_routes_version(admin: str) -> str | None:
    """The ``version_info`` of the routes Envoy serves from ``xds/rds.yaml``."""
    dump = json.loads(admin_get(admin, "/config_dump?resource=dynamic_route_configs"))
    versions = [str(c.get("version_info")) for c in dump.get("configs", [])]
    return versions[0] if versions else None


def envoy_hosts(admin: str) -> dict[str, set[str]]:
    """Cluster → its hosts Envoy counts healthy (admin ``/clusters``; every cluster listed)."""
    out: dict[str, set[str]] = {}
    for line in admin_get(admin, "/clusters").splitlines():
        parts = line.split("::")
        hosts = out.setdefault(parts[0], set())
        if len(parts) == 4 and parts[2] == "health_flags" and parts[3] == "healthy":
            hosts.add(parts[1])
    return out


def reload_count(metrics_url: str, prefix: str) -> float:
    """``PREFIX_config_reloads_total`` of every result, from a service's ``/metrics``."""
    with urllib.request.urlopen(metrics_url, timeout=2) as resp:
        text = resp.read().decode("utf-8", "replace")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"{prefix}_config_reloads_total{{"))


def wait_until(ready: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``ready()`` (an ``OSError`` or bad answer counts as not yet); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return False


@dataclass
class Settle:
    """When to act on a folder's signature: once it has stayed the same for one poll (a file
    being written is not read half way), and once per change, whether it loads or not (a
    broken file is reported once, not every poll)."""

    seen: Hashable
    applied: Hashable

    def due(self, signature: Hashable) -> bool:
        settled, self.seen = signature == self.seen, signature
        if not settled or signature == self.applied:
            return False
        self.applied = signature
        return True


def signature_of(folder: str) -> Hashable:
    from sidecar_runtime.process.reload import path_signature
    return path_signature(folder)


def new_port() -> int:
    return free_port(LOOPBACK)


class ModelsGateway:
    """The processes of ``up --models`` and the set of models they serve; :meth:`tick` follows
    the folder (called by :func:`llm_sidecar.up.serve` every half second)."""

    def __init__(self, folder: str, base: dict[str, Any], base_source: str, *, gpus: str | None,
                 extproc_metrics_port: int, ratelimit_metrics_port: int) -> None:
        self._folder = folder
        self._base = base
        self._source = base_source
        self._gpus = gpus
        self._metrics = [(f"http://{LOOPBACK}:{extproc_metrics_port}/metrics", "extproc"),
                         (f"http://{LOOPBACK}:{ratelimit_metrics_port}/metrics", "ratelimit")]
        self._ports = (extproc_metrics_port, ratelimit_metrics_port)
        self._served: Served | None = None
        self._children: list[Child] = []
        self._pods: dict[str, tuple[Pod, Child]] = {}
        self._xds_written: dict[str, str] = {}
        self._workdir = ""
        self._settle = Settle(None, None)

    @property
    def served(self) -> Served:
        if self._served is None:
            raise RuntimeError("ModelsGateway.first() was not called")
        return self._served

    def first(self) -> Served:
        """The set to start with: the folder's models, or none when it does not load (its
        problems are printed). A base that is not valid raises :class:`ConfigError`."""
        signature = signature_of(self._folder)
        self._settle = Settle(signature, signature)
        served = self._load({}, None)
        self._served = served or build(self._base, [], {}, new_port, self._source)
        return self._served

    def start(self, workdir: str) -> list[Child]:
        """Start the pods, then extproc, ratelimit and Envoy (:func:`llm_sidecar.up.start_all`)."""
        from llm_sidecar.up import start_all
        self._workdir = workdir
        served = self.served
        self._write_routing(served, wait=False)
        try:
            self._start_pods(list(pods_of(served.config).values()))
            core = start_all(served.config, self._routing_path, workdir,
                             extproc_metrics_port=self._ports[0],
                             ratelimit_metrics_port=self._ports[1], start_sims=False)
        except BaseException:
            self._stop_pods([pod for pod, _ in self._pods.values()])
            raise
        self._children.extend(core)
        say(models_line(None, served))
        return self._children

    def tick(self) -> None:
        """Apply the folder if it changed and then stayed the same for one poll."""
        if not self._settle.due(signature_of(self._folder)):
            return
        try:
            self._reload()
        except Exception as exc:  # never take the gateway down over one change
            say(f"{self._folder}: applying the change failed ({exc!r}); serving "
                f"{_names(self.served.models)} as before")

    @property
    def _routing_path(self) -> str:
        return os.path.join(self._workdir, "routing.yaml")

    def _load(self, previous: Mapping[str, tuple[str, int]],
              serving: tuple[str, ...] | None) -> Served | None:
        """The folder built on ``previous`` ports; None (its problems printed) when it does
        not load. ``serving``: the models served now (None: starting)."""
        try:
            return build(self._base, plan_folder(self._folder, self._gpus), previous, new_port,
                         self._source)
        except ConfigError as err:
            for problem in err.problems:
                print(str(problem), file=sys.stderr, flush=True)
            now = ("starting with no model until it loads" if serving is None
                   else f"serving {_names(serving)} as before")
            say(f"{self._folder}: not applied; {now}")
            return None

    def _reload(self) -> None:
        began = time.monotonic()
        old = self.served
        new = self._load(old.ports, old.models)
        if new is None or new.doc == old.doc:
            return
        running = {endpoint: pod for endpoint, (pod, _) in self._pods.items()}
        change = pod_changes(running, pods_of(new.config))
        try:
            self._start_pods(list(change.start))
        except (RuntimeError, TimeoutError, OSError) as exc:
            say(f"{self._folder}: a simulator did not start ({exc}); serving "
                f"{_names(old.models)} as before")
            self._stop_pods([p for p in change.start if p.endpoint not in running])
            return
        new_hosts = {(pod.cluster, pod.endpoint) for pod in change.start}
        self._write_xds(make_before_break(old.config, new.config), new_hosts, set())
        self._write_routing(new, wait=True)
        self._served = new
        self._write_xds(new.config, set(), set(old.config.clusters) - set(new.config.clusters))
        self._stop_pods(list(change.stop))
        say(f"{models_line(old, new)} (applied in {time.monotonic() - began:.1f} s)")
        self._check_bootstrap(old.config, new.config)

    def _start_pods(self, pods: list[Pod]) -> None:
        """Start ``pods`` together, then wait for each one's ``/health``."""
        from sidecar_runtime.process.procs import start, wait_http_ok
        for pod in pods:
            if pod.endpoint in self._pods:  # the same address with other settings
                self._stop_pods([self._pods[pod.endpoint][0]])
            port = parse_hostport(pod.endpoint)[1]
            child = start(f"sim {pod.cluster}", pod.command(),
                          log_path=os.path.join(self._workdir, f"sim-{pod.cluster}-{port}.log"))
            self._pods[pod.endpoint] = (pod, child)
            self._children.insert(0, child)  # stopped after Envoy and the services
        for pod in pods:
            wait_http_ok(pod.health_url, 30, self._pods[pod.endpoint][1])

    def _stop_pods(self, pods: list[Pod]) -> None:
        for pod in pods:
            entry = self._pods.pop(pod.endpoint, None)
            if entry is not None:
                self._children.remove(entry[1])
                entry[1].stop()

    def _write_xds(self, config: RoutingConfig, healthy: set[tuple[str, str]],
                   gone: set[str]) -> None:
        """Envoy's pool files for ``config``, then wait until Envoy serves them: its routes'
        version, each pod of ``healthy`` healthy and no cluster of ``gone`` left."""
        import yaml

        from routing.render import write_text, xds_files
        from routing.render.xds import CDS_PATH, RDS_PATH
        files = xds_files(config)
        for name in (CDS_PATH, RDS_PATH):
            if self._xds_written.get(name) != files[name]:
                write_text(os.path.join(self._workdir, name), files[name])
                self._xds_written[name] = files[name]
        version = str(yaml.safe_load(files[RDS_PATH])["version_info"])
        admin = config.envoy.admin

        def applied() -> bool:
            hosts = envoy_hosts(admin)
            return (envoy_routes_version(admin) == version
                    and all(e in hosts.get(c, set()) for c, e in healthy)
                    and not gone & set(hosts))
        if not wait_until(applied, 15):
            say("Envoy did not apply the new pools within 15 s; going on")

    def _write_routing(self, served: Served, *, wait: bool) -> None:
        """The routing YAML extproc and ratelimit read; with ``wait``, until both reloaded it."""
        from routing.render import dump
        from sidecar_runtime.process.files import replace_file
        before = [self._reloads(url, prefix) for url, prefix in self._metrics] if wait else []
        text = (f"# Written by `llm-sidecar up --models {self._folder}` from {self._source} "
                "and the LLMModels there; rewritten on every change.\n" + dump(served.doc))
        replace_file(self._routing_path, text.encode("utf-8"))
        if wait and not wait_until(lambda: all(
                self._reloads(url, prefix) > count
                for (url, prefix), count in zip(self._metrics, before, strict=True)), 15):
            say("extproc or ratelimit did not reload the routing YAML within 15 s; going on")

    @staticmethod
    def _reloads(url: str, prefix: str) -> float:
        try:
            return reload_count(url, prefix)
        except (OSError, ValueError):
            return -1.0

    @staticmethod
    def _check_bootstrap(old: RoutingConfig, new: RoutingConfig) -> None:
        from routing.render.envoy import bootstrap_fingerprint
        if bootstrap_fingerprint(old) != bootstrap_fingerprint(new):
            say("this change needs an Envoy restart to be complete (it changes more than "
                "pools): stop and start llm-sidecar up")


def _names(models: Sequence[str]) -> str:
    return ", ".join(models) or "no model"


def run(args: argparse.Namespace) -> int:
    """``up --models DIR``: exit 1 with the reason for a folder or base that cannot be used."""
    from llm_sidecar.up import local_ports, port_problems, serve

    folder: str = args.models
    if not os.path.isdir(folder):
        print(f"llm-sidecar up: --models {folder}: not a folder", file=sys.stderr)
        return 1
    from llmmodel.catalog import load_gpus
    load_gpus(args.gpus)  # a bad --gpus FILE stops here, with its FILE:LINE lines
    gateway = ModelsGateway(folder, base_document(args.config), args.config or "the built-in base",
                            gpus=args.gpus, extproc_metrics_port=args.extproc_metrics_port,
                            ratelimit_metrics_port=args.ratelimit_metrics_port)
    served = gateway.first()
    problems = port_problems(local_ports(served.config, args.extproc_metrics_port,
                                         args.ratelimit_metrics_port))
    if problems:
        for problem in problems:
            print(f"llm-sidecar up: {problem}", file=sys.stderr)
        return 1
    return serve(served.config.envoy.listen, gateway.start, gateway.tick)
