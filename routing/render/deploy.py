"""Container deployments of a routing YAML: docker compose and Kubernetes manifests.

Both run the same processes as ``llm-sidecar up``, one container each: Envoy (its bootstrap
rendered from the routing YAML when it starts), extproc, ratelimit, Redis, and a vLLM simulator
per ``simulate:`` cluster. The routing YAML they mount is the source config with container
addresses: simulated pools at ``<cluster>:8000`` (a Service or compose service of that name),
extproc and ratelimit at their service names, Envoy's listener on all interfaces and its
admin on loopback. Everything is derived from one config, so the names always line up.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from routing.render.netpol import LABEL, PART_OF, network_policies
from routing.schema import RoutingConfig
from routing.units import parse_hostport
from sidecar_runtime.process.settings import Settings
from sidecar_runtime.process.workers import KILL_MARGIN_S

IMAGE = "llm-sidecar:dev"
SIM_PORT = 8000
EXTPROC, RATELIMIT, GATEWAY = "llm-sidecar-extproc", "llm-sidecar-ratelimit", "llm-gateway"
EXTPROC_METRICS, RATELIMIT_METRICS = 9101, 9102
CONFIG_DIR = "/etc/llm-sidecar"
ENVOY_DIR = "/etc/envoy"
ROUTING_CONFIGMAP = "llm-sidecar-routing"
SECRET = "llm-sidecar"
REDIS_PORT = 6379

SERVICE_GRACE_S = int(Settings.model_fields["shutdown_grace_s"].default + KILL_MARGIN_S)
"""extproc's and ratelimit's terminationGracePeriodSeconds: their drain (the default
LLM_SIDECAR_SHUTDOWN_GRACE_S) and a margin."""
GATEWAY_MEMORY_LIMIT_MIB = 1024
ENVOY_MAX_HEAP_BYTES = GATEWAY_MEMORY_LIMIT_MIB * 3 // 4 * 1024 * 1024
"""``envoy.max_heap_bytes`` of the deployed routing YAML (unless it sets one): 3/4 of the
gateway container's memory limit, leaving room for what tcmalloc's heap does not count
(thread stacks, the binary, freed pages not yet returned) before the kernel's OOM killer."""


@dataclass(frozen=True)
class RedisRole:
    """One Redis of the deployment, for one service and one kind of data.

    Two, because one eviction policy cannot suit both: rate-limit buckets and concurrency
    leases (ratelimit's ``rl:*`` keys; a bucket's PEXPIRE is the time until it is full again,
    so expiry is safe) must never be evicted before that, since an evicted bucket comes back
    full and hands out its capacity again; embedding-cache
    entries (extproc's, also with TTLs, of days) may always be. With one Redis, no policy
    orders them: ``volatile-ttl`` evicts the shortest TTLs first, which are the buckets,
    and ``volatile-lru``/``allkeys-lru`` evict an idle bucket before a recent cache entry.
    extproc uses Redis only for the cache and ratelimit only for buckets, each from its own
    ``LLM_SIDECAR_REDIS_URL``, so the split needs no code.
    """

    name: str
    user: str
    """The one service that uses it."""
    maxmemory_mb: int
    policy: str
    memory_limit_mib: int
    """The container's memory limit: maxmemory plus room for fragmentation and client
    buffers, which ``maxmemory`` does not count."""

    def args(self, password: str) -> list[str]:
        return ["redis-server", "--requirepass", password, "--save", "", "--appendonly", "no",
                "--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", self.policy]

    def url(self, password: str) -> str:
        return f"redis://:{password}@{self.name}:{REDIS_PORT}/0"


REDIS_BUCKETS = RedisRole("redis-buckets", RATELIMIT, 128, "noeviction", 256)
"""Full: every write (every decision) fails with OOM, which ratelimit answers as a Redis
outage (``on_backend_error``); nothing is ever evicted. A bucket key is ~130 bytes (Redis's
MEMORY USAGE), so 128 MB holds about a million buckets; a bucket expires once it would be full
again, so only buckets in use take room."""
REDIS_CACHE = RedisRole("redis-cache", EXTPROC, 512, "allkeys-lru", 768)
"""Full: the least recently used vectors are evicted to make room; writes never fail."""
REDIS_ROLES = (REDIS_BUCKETS, REDIS_CACHE)


def extproc_reaches(config: RoutingConfig) -> frozenset[str]:
    """The pools extproc itself sends to: ``endpoint_picker`` pools (it scrapes each pod's
    ``/metrics``) and the canary pools of models with ``canary.compare`` (its shadow requests,
    docs: Canary verdict)."""
    canaries = {model.canary.cluster for model in config.models.values()
                if model.canary is not None and model.canary.compare is not None}
    return frozenset(name for name, spec in config.clusters.items()
                     if spec.endpoint_picker is not None or name in canaries)


def container_doc(doc: dict[str, Any], config: RoutingConfig) -> dict[str, Any]:
    """The routing YAML ``doc`` with the addresses it has inside the deployment."""
    out = copy.deepcopy(doc)
    _, listen_port = parse_hostport(config.envoy.listen)
    _, admin_port = parse_hostport(config.envoy.admin)
    _, extproc_port = parse_hostport(config.services.extproc)
    _, ratelimit_port = parse_hostport(config.services.ratelimit)
    out["envoy"] = {"max_heap_bytes": ENVOY_MAX_HEAP_BYTES, **out.get("envoy", {}),
                    "listen": f"0.0.0.0:{listen_port}", "admin": f"127.0.0.1:{admin_port}"}
    out["services"] = {**out.get("services", {}), "extproc": f"{EXTPROC}:{extproc_port}",
                       "ratelimit": f"{RATELIMIT}:{ratelimit_port}"}
    for name, spec in config.clusters.items():
        if spec.simulator is not None:
            cluster = out["clusters"][name]
            cluster["endpoints"] = [f"{name}:{SIM_PORT}"]
            del cluster["simulate"]
    return out


def sim_command(name: str, config: RoutingConfig) -> list[str]:
    spec = config.clusters[name]
    sim = spec.simulator
    assert sim is not None
    return ["sim", "--host", "0.0.0.0", "--port", str(SIM_PORT), "--name", name,
            "--max-model-len", str(spec.max_context), *sim.sim_flags()]


def _ports(config: RoutingConfig) -> dict[str, int]:
    return {"listen": parse_hostport(config.envoy.listen)[1],
            "extproc": parse_hostport(config.services.extproc)[1],
            "ratelimit": parse_hostport(config.services.ratelimit)[1]}


def _python_probe(url: str) -> list[str]:
    """A health check for images without curl: the image has Python."""
    return ["python", "-c", f"import urllib.request; urllib.request.urlopen('{url}', timeout=2)"]


def _redis_of(service: str) -> RedisRole:
    return next(role for role in REDIS_ROLES if role.user == service)


def compose(config: RoutingConfig, routing_file: str) -> dict[str, Any]:
    """``docker-compose.yml``; ``routing_file`` is the container routing YAML, relative to it."""
    ports = _ports(config)
    routing = f"{CONFIG_DIR}/routing.yaml"
    password = "${REDIS_PASSWORD:-change-me}"
    key_id_secret = "${KEY_ID_SECRET:-change-me}"
    sims = [name for name, spec in config.clusters.items() if spec.simulator is not None]
    healthy = {"condition": "service_healthy"}

    def health(url: str) -> dict[str, Any]:
        return {"test": ["CMD", *_python_probe(url)], "interval": "5s", "timeout": "3s",
                "retries": 12}

    services: dict[str, Any] = {
        role.name: {
            "image": "redis:7-alpine",
            "command": role.args(password),
            "mem_limit": f"{role.memory_limit_mib}m",
            "healthcheck": {"test": ["CMD-SHELL", "redis-cli -a \"$$REDIS_PASSWORD\" ping"],
                            "interval": "5s", "timeout": "3s", "retries": 12},
            "environment": {"REDIS_PASSWORD": password},
        } for role in REDIS_ROLES
    }
    for name, port, metrics in ((EXTPROC, ports["extproc"], EXTPROC_METRICS),
                                (RATELIMIT, ports["ratelimit"], RATELIMIT_METRICS)):
        command = "extproc" if name == EXTPROC else "ratelimit"
        services[name] = {
            "build": ".", "image": IMAGE,
            "command": [command, "--config", routing, "--host", "0.0.0.0", "--port", str(port),
                        "--metrics-port", str(metrics)],
            "environment": {"LLM_SIDECAR_REDIS_URL": _redis_of(name).url(password),
                            "LLM_SIDECAR_KEY_ID_SECRET": key_id_secret},
            # The directory, not the file: an edited file on the host is then seen by reload.
            "volumes": [f"./{routing_file.rsplit('/', 1)[0]}:{CONFIG_DIR}:ro"],
            "healthcheck": health(f"http://127.0.0.1:{metrics}/healthz"),
            "depends_on": {_redis_of(name).name: healthy},
            # Docker's own 10 s would SIGKILL the 30 s drain (as the Kubernetes grace above).
            "stop_grace_period": f"{SERVICE_GRACE_S}s",
        }
    services[GATEWAY] = {
        "build": ".", "image": IMAGE,
        "entrypoint": ["sh", "-c"],
        # Render the bootstrap from the mounted routing YAML, then become Envoy.
        "command": [f"llm-sidecar render --config {routing} --out /tmp/envoy && exec envoy "
                    "-c /tmp/envoy/envoy.yaml --log-level warn --drain-time-s 15"],
        "volumes": [f"./{routing_file.rsplit('/', 1)[0]}:{CONFIG_DIR}:ro"],
        "ports": [f"{ports['listen']}:{ports['listen']}"],
        "mem_limit": f"{GATEWAY_MEMORY_LIMIT_MIB}m",
        "healthcheck": health(f"http://127.0.0.1:{ports['listen']}/healthz"),
        "depends_on": {EXTPROC: healthy, RATELIMIT: healthy, **{s: healthy for s in sims}},
    }
    for name in sims:
        services[name] = {"build": ".", "image": IMAGE, "command": sim_command(name, config),
                          "healthcheck": health(f"http://127.0.0.1:{SIM_PORT}/health")}
    return {"services": services}


# --- Kubernetes -------------------------------------------------------------------------------

SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False}


def _meta(name: str) -> dict[str, Any]:
    return {"name": name, "labels": {LABEL: name, **PART_OF}}


def _http_probe(path: str, port: int | str, *, period: int = 5, failures: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _deployment(name: str, replicas: int, containers: list[dict[str, Any]],
                volumes: list[dict[str, Any]] | None = None,
                init: list[dict[str, Any]] | None = None,
                grace_s: int = 30) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": grace_s, "containers": containers}
    if init:
        spec["initContainers"] = init
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name), "spec": {
        "replicas": replicas, "selector": {"matchLabels": {LABEL: name}},
        "template": {"metadata": {"labels": {LABEL: name, **PART_OF}}, "spec": spec}}}


def _service(name: str, ports: list[tuple[str, int]], *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {LABEL: name}, "ports": [
        {"name": port_name, "port": port, "targetPort": port_name} for port_name, port in ports]}
    if headless:
        # One DNS record per pod: Envoy's STRICT_DNS cluster balances across all of them, and
        # an endpoint picker resolves the pods it scores (a pick names a pod's IP).
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name), "spec": spec}


def _container(name: str, args: list[str], ports: list[tuple[str, int]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": IMAGE, "imagePullPolicy": "IfNotPresent", "args": args,
            "ports": [{"name": n, "containerPort": p} for n, p in ports],
            "securityContext": SECURITY, **extra}


def _secret_env(service: str) -> list[dict[str, Any]]:
    return [{"name": env, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key}}}
            for env, key in (("LLM_SIDECAR_REDIS_URL", f"{_redis_of(service).name}-url"),
                             ("LLM_SIDECAR_KEY_ID_SECRET", "key-id-secret"))]


def kubernetes(config: RoutingConfig, routing_text: str) -> dict[str, list[dict[str, Any]]]:
    """File name under ``deploy/k8s/`` → its manifests; ``routing_text`` goes in the ConfigMap."""
    ports = _ports(config)
    routing = f"{CONFIG_DIR}/routing.yaml"
    # Mounted as a directory (never subPath): the kubelet then swaps ..data on a ConfigMap
    # update, and extproc and ratelimit reload it within seconds.
    config_volume = {"name": "routing", "configMap": {"name": ROUTING_CONFIGMAP}}
    config_mount = {"name": "routing", "mountPath": CONFIG_DIR, "readOnly": True}
    routing_docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(ROUTING_CONFIGMAP),
         "data": {"routing.yaml": routing_text}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(SECRET), "type": "Opaque",
         "stringData": {**{f"{role.name}-url": role.url("change-me") for role in REDIS_ROLES},
                        "key-id-secret": "change-me", "redis-password": "change-me"}},
    ]
    services: list[dict[str, Any]] = []
    for name, port, metrics in ((EXTPROC, ports["extproc"], EXTPROC_METRICS),
                                (RATELIMIT, ports["ratelimit"], RATELIMIT_METRICS)):
        command = "extproc" if name == EXTPROC else "ratelimit"
        container = _container(
            command, [command, "--config", routing, "--host", "0.0.0.0", "--port", str(port),
                      "--metrics-port", str(metrics)],
            [("grpc", port), ("metrics", metrics)],
            env=_secret_env(name), volumeMounts=[config_mount],
            readinessProbe=_http_probe("/healthz", "metrics"),
            livenessProbe=_http_probe("/healthz", "metrics", period=10, failures=6),
            resources={"requests": {"cpu": "250m", "memory": "256Mi"}})
        # Above the service's own drain (its streams in flight get LLM_SIDECAR_SHUTDOWN_GRACE_S)
        # by the margin a worker supervisor waits before it kills: the kubelet's SIGKILL must
        # not cut the drain short.
        services += [_deployment(name, 2, [container], [config_volume], grace_s=SERVICE_GRACE_S),
                     _service(name, [("grpc", port), ("metrics", metrics)])]
    for role in REDIS_ROLES:
        redis_container = {
            "name": "redis", "image": "redis:7-alpine", "imagePullPolicy": "IfNotPresent",
            "args": role.args("$(REDIS_PASSWORD)"),
            "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
                "name": SECRET, "key": "redis-password"}}}],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
            "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
            "resources": {"requests": {"memory": f"{role.memory_limit_mib}Mi"},
                          "limits": {"memory": f"{role.memory_limit_mib}Mi"}},
        }
        services += [_deployment(role.name, 1, [redis_container]),
                     _service(role.name, [("redis", REDIS_PORT)])]

    envoy_mount = {"name": "envoy", "mountPath": ENVOY_DIR}
    render = _container("render", ["render", "--config", routing, "--out", ENVOY_DIR], [],
                        volumeMounts=[config_mount, envoy_mount])
    del render["ports"]
    admin_port = parse_hostport(config.envoy.admin)[1]
    drain = ("import time, urllib.request; urllib.request.urlopen(urllib.request.Request("
             f"'http://127.0.0.1:{admin_port}/healthcheck/fail', method='POST')); time.sleep(15)")
    envoy = _container(
        "envoy", ["-c", f"{ENVOY_DIR}/envoy.yaml", "--log-level", "warn", "--drain-time-s", "15"],
        [("http", ports["listen"])], command=["envoy"], volumeMounts=[envoy_mount],
        readinessProbe=_http_probe("/healthz", "http"),
        livenessProbe=_http_probe("/healthz", "http", period=10, failures=6),
        # Fail /healthz first so the Service stops sending, then let streams finish.
        lifecycle={"preStop": {"exec": {"command": ["python", "-c", drain]}}},
        # envoy.max_heap_bytes in the ConfigMap is 3/4 of this limit (container_doc).
        resources={"requests": {"cpu": "500m", "memory": "256Mi"},
                   "limits": {"memory": f"{GATEWAY_MEMORY_LIMIT_MIB}Mi"}})
    containers = [envoy]
    if config.envoy.dynamic_pools:
        # Renders again when the ConfigMap changes: Envoy applies the pools from the xds/ files
        # it watches, so a pool added by hand or by the LLMModel operator needs no restart.
        watcher = _container("render-watch", ["render", "--config", routing, "--out", ENVOY_DIR,
                                              "--watch"], [],
                             volumeMounts=[config_mount, envoy_mount],
                             resources={"requests": {"cpu": "10m", "memory": "64Mi"}})
        del watcher["ports"]
        containers.append(watcher)
    gateway = [
        _deployment(GATEWAY, 2, containers, [config_volume, {"name": "envoy", "emptyDir": {}}],
                    init=[render], grace_s=330),
        _service(GATEWAY, [("http", ports["listen"])]),
    ]
    pools: list[dict[str, Any]] = []
    for name, spec in config.clusters.items():
        if spec.simulator is None:
            continue
        sim = _container("vllm", sim_command(name, config), [("http", SIM_PORT)],
                         readinessProbe=_http_probe("/health", "http"),
                         livenessProbe=_http_probe("/health", "http", period=10, failures=6))
        pools += [_deployment(name, 1, [sim]), _service(name, [("http", SIM_PORT)], headless=True)]
    policies = network_policies(
        gateway=GATEWAY, extproc=EXTPROC, ratelimit=RATELIMIT,
        redis_of={role.name: role.user for role in REDIS_ROLES},
        pools=[name for name, spec in config.clusters.items() if spec.simulator is not None],
        picked=extproc_reaches(config))
    return {"routing.yaml": routing_docs, "services.yaml": services, "gateway.yaml": gateway,
            "pools.yaml": pools, "networkpolicies.yaml": policies}
