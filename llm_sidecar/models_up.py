"""``llm-sidecar up --models DIR``: the local gateway serving every LLMModel in DIR on simulated
pods sized by its plan, following DIR while it runs.

The base routing YAML (``--config``, else
:data:`llm_sidecar.models_served.BUILTIN_BASE`) is merged with the plans of the
models (:func:`llmmodel.routing_merge.merge_routing`) and served with ``envoy.dynamic_pools``:
Envoy reads the pools from files it watches, so a model added, changed or removed never
restarts Envoy. A change is applied make-before-break:

1. the new pods (simulators) start, and are waited for;
2. Envoy gets every old and new pool and pod (the xDS files), and is waited for (admin);
3. the routing YAML is replaced: extproc and ratelimit reload it live (waited for on their
   ``*_config_reloads_total``); from here requests go to the new pools only;
4. Envoy's files lose what is gone, then the pods that are gone stop.

The waits of steps 2 and 3 are :mod:`llm_sidecar.gateway_wait`'s.

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
import os
import sys
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_sidecar.gateway_wait import reload_counts, wait_envoy_applied, wait_reloaded
from llm_sidecar.models_served import (
    LOOPBACK,
    Pod,
    Served,
    base_document,
    build,
    make_before_break,
    models_line,
    plan_folder,
    pod_changes,
    pods_of,
)
from routing.errors import ConfigError
from routing.schema import RoutingConfig
from routing.units import parse_hostport
from sidecar_runtime.process.procs import Child, free_port


def say(text: str) -> None:
    print(f"llm-sidecar up: {text}", file=sys.stderr, flush=True)


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
        from routing.render import write_text, xds_documents, xds_files
        from routing.render.xds import CDS_PATH, RDS_PATH
        documents = xds_documents(config)
        files = xds_files(documents)
        for name in (CDS_PATH, RDS_PATH):
            if self._xds_written.get(name) != files[name]:
                write_text(os.path.join(self._workdir, name), files[name])
                self._xds_written[name] = files[name]
        version = str(documents[RDS_PATH]["version_info"])
        if not wait_envoy_applied(config.envoy.admin, version, healthy, gone, 15):
            say("Envoy did not apply the new pools within 15 s; going on")

    def _write_routing(self, served: Served, *, wait: bool) -> None:
        """The routing YAML extproc and ratelimit read; with ``wait``, until both reloaded it."""
        from llmmodel.routing_merge import comment
        from routing.render import dump
        from sidecar_runtime.process.files import replace_file
        before = reload_counts(self._metrics) if wait else []
        text = comment(f"Written by `llm-sidecar up --models {self._folder}` from {self._source} "
                       "and the LLMModels there; rewritten on every change.") + dump(served.doc)
        replace_file(self._routing_path, text.encode("utf-8"))
        if wait and not wait_reloaded(self._metrics, before, 15):
            say("extproc or ratelimit did not reload the routing YAML within 15 s; going on")

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
