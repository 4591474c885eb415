"""``llm-sidecar operator``: its flags, the kopf handlers, and the run that hands them to kopf.

The kopf adapter of :mod:`llmmodel.operator` (which holds the reconcile logic and imports no
kopf). kopf serves one namespace (the pod's own by default, the one whose routing ConfigMap the
gateway mounts) and runs without namespace or CRD observation, so the operator needs no
ClusterRole (deploy/operator/rbac.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from routing.units import join_hostport, parse_hostport

if TYPE_CHECKING:  # kopf and aiohttp load only when the operator runs, not for every command
    import kopf

    from llmmodel.kube_api import KubeApi
    from llmmodel.operator_plan import OperatorSettings, Toolkit
    from llmmodel.operator_status import Emit

GROUP, VERSION, PLURAL = "llm-sidecar.dev", "v1alpha1", "llmmodels"

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def pod_namespace(path: str = NAMESPACE_FILE) -> str:
    """The namespace this pod runs in (its service account's), else ``default``."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or "default"
    except OSError:
        return "default"


def _liveness(value: str) -> str:
    """``host:port`` of kopf's health endpoint, as the URL kopf takes."""
    try:
        host, port = parse_hostport(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give host:port, like 0.0.0.0:8080") from None
    return f"http://{join_hostport(host, port)}/healthz"


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None,
                        help="the namespace to serve: its LLMModels, pools and routing ConfigMap "
                             "(default: the pod's own, else 'default')")
    parser.add_argument("--image", default=None,
                        help="the vLLM image of the pools' Deployments (default: the one "
                             "`onboard` writes)")
    parser.add_argument("--routing-configmap", default="llm-sidecar-routing",
                        help="the ConfigMap (key routing.yaml) the gateway mounts; the operator "
                             "writes it")
    parser.add_argument("--base-configmap", default="llm-sidecar-routing-base",
                        help="the ConfigMap (key routing.yaml) holding the hand-written routing "
                             "YAML the models are merged into")
    parser.add_argument("--gpus", metavar="FILE", default=None,
                        help="GPU catalog additions and the nodes (see `llm-sidecar plan`)")
    parser.add_argument("--allow-host-paths", action="store_true",
                        help="let an LLMModel's modelPath be a path on the GPU node (a hostPath "
                             "mount); off, such a model is refused (Planned=False), since anyone "
                             "who may create an LLMModel could mount any directory of a node")
    parser.add_argument("--allow-gateway-limits", action="store_true",
                        help="let an LLMModel set limits.tenant and limits.api_key, which change "
                             "the gateway's limits for every model; off, such a model is refused "
                             "(Planned=False)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering with other operator replicas (no KopfPeering CRD "
                             "needed); run one replica")
    parser.add_argument("--liveness", metavar="HOST:PORT", type=_liveness, default=None,
                        help="serve kopf's liveness endpoint /healthz here, like 0.0.0.0:8080")


def operator_command(args: argparse.Namespace) -> int:
    """Run the operator until SIGTERM. A bad ``--gpus`` file raises ``ConfigError`` (the CLI
    prints it, exit 1) before anything connects."""
    import kopf

    from llmmodel.kube_api import InClusterApi, KubeApiError
    from llmmodel.operator_plan import OperatorSettings, default_toolkit

    settings = OperatorSettings(
        namespace=args.namespace or pod_namespace(), image=args.image,
        routing_configmap=args.routing_configmap, base_configmap=args.base_configmap,
        gpus_path=args.gpus, allow_host_paths=args.allow_host_paths,
        allow_gateway_limits=args.allow_gateway_limits)
    toolkit = default_toolkit(settings)
    try:
        api = InClusterApi()
    except KubeApiError as err:
        print(f"llm-sidecar operator: {err}", file=sys.stderr)
        return 1
    registry = kopf.OperatorRegistry()
    register_handlers(registry, api, settings, toolkit)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: object) -> None:
        await api.close()

    kopf.run(registry=registry, settings=kopf_settings(), standalone=args.standalone,
             namespaces=[settings.namespace], liveness_endpoint=args.liveness)
    return 0


def kopf_settings() -> kopf.OperatorSettings:
    """Namespaced and strict: no namespace or CRD observation (that would need a ClusterRole to
    list namespaces and CRDs, see kopf's ``ScanningSettings``), progress in our own annotations
    so ``.status`` holds only what the contract names."""
    import kopf

    out = kopf.OperatorSettings()
    out.scanning.disabled = True
    out.persistence.finalizer = "llm-sidecar.dev/operator"
    out.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="llm-sidecar.dev")
    out.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="llm-sidecar.dev")
    return out


Handler = Callable[..., Awaitable[None]]


@dataclass(frozen=True)
class Handlers:
    """The handlers :func:`register_handlers` put on a registry (tests call them directly)."""

    on_change: Handler
    on_delete: Handler
    on_timer: Handler


def register_handlers(registry: kopf.OperatorRegistry, api: KubeApi, settings: OperatorSettings,
                      toolkit: Toolkit) -> Handlers:
    """The kopf handlers of one operator process, on ``registry``; an API failure becomes a
    kopf retry, a bad spec never does (reconcile reports it in the status instead)."""
    import kopf

    from llmmodel.kube_api import KubeApiError
    from llmmodel.operator import READY_INTERVAL_S, reconcile, refresh, remove

    def emitter(body: kopf.Body) -> Emit:
        return lambda kind, reason, message: kopf.event(body, type=kind, reason=reason,
                                                        message=message)

    # One step at a time: two models' rebuilds of the shared routing ConfigMap must not
    # interleave (each lists the models, then writes; a stale list written last drops a model).
    lock = asyncio.Lock()

    async def guarded(step: Callable[[], Awaitable[object]]) -> None:
        try:
            async with lock:
                await step()
        except KubeApiError as err:
            raise kopf.TemporaryError(str(err), delay=10) from None

    async def on_change(body: kopf.Body, **_: Any) -> None:
        await guarded(lambda: reconcile(api, copy.deepcopy(dict(body)), settings=settings,
                                        toolkit=toolkit, emit=emitter(body)))

    async def on_delete(body: kopf.Body, **_: Any) -> None:
        await guarded(lambda: remove(api, copy.deepcopy(dict(body)), settings=settings,
                                     toolkit=toolkit, emit=emitter(body)))

    async def on_timer(body: kopf.Body, **_: Any) -> None:
        await guarded(lambda: refresh(api, copy.deepcopy(dict(body)), settings=settings,
                                      toolkit=toolkit, emit=emitter(body)))

    # Named ids: kopf logs them and keys its progress annotations by them.
    for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
        decorator(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)(on_change)
    kopf.on.delete(GROUP, VERSION, PLURAL, id="remove", registry=registry)(on_delete)
    kopf.timer(GROUP, VERSION, PLURAL, id="refresh", interval=READY_INTERVAL_S,
               registry=registry)(on_timer)
    return Handlers(on_change, on_delete, on_timer)
