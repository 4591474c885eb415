"""``llm-sidecar up``: the whole gateway on this machine, stopped cleanly by Ctrl-C or SIGTERM.

Renders the config to a temp dir, starts a vLLM simulator per ``simulate: true`` cluster,
extproc, ratelimit (when the config has ``rate_limits``) and Envoy, waits until all are ready,
prints the URL, and stops every child when it is told to or when any child dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from importlib import resources

from routing.loader import load_config, local_listeners
from routing.render import write_all
from routing.schema import RoutingConfig
from routing.units import join_hostport, parse_hostport, parse_service_address
from sidecar_runtime.process.grpc_listen import HELD_PORT_WAIT_S, listening
from sidecar_runtime.process.procs import (
    Child,
    envoy_binary,
    sidecar_command,
    start,
    wait_http_ok,
    wait_tcp,
    wait_unix,
)
from sidecar_runtime.wire.names import UNIX_PREFIX


def example_config_path() -> str:
    return str(resources.files("llm_sidecar").joinpath("example.yaml"))


def connect_host(host: str) -> str:
    """Where to connect to reach a listener bound to ``host`` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)


def local_url(host: str, port: int, path: str = "") -> str:
    """The ``http://`` URL of ``path`` on a listener bound to ``host``:``port`` (an IPv6
    address in brackets)."""
    return f"http://{join_hostport(connect_host(host), port)}{path}"


def _wait_service(address: str, child: Child) -> None:
    """Until the gRPC service at ``address`` (``host:port`` or ``unix:/path``) accepts."""
    host, port = parse_service_address(address)
    if host.startswith(UNIX_PREFIX):
        wait_unix(host[len(UNIX_PREFIX):], 30, child)
    else:  # a port a connection still holds is waited for by the service itself
        wait_tcp(connect_host(host), port, 30 + HELD_PORT_WAIT_S, child)


def local_ports(config: RoutingConfig, extproc_metrics_port: int,
                ratelimit_metrics_port: int) -> list[tuple[str, str, int]]:
    """(what, host, port) of every TCP port ``up`` will listen on: the config's
    (:func:`routing.loader.local_listeners`) and the services' metrics ports."""
    found = [(".".join(map(str, path[:3])), *parse_hostport(address))
             for path, address in local_listeners(config)]
    found.append(("extproc's metrics (--extproc-metrics-port)", "127.0.0.1",
                  extproc_metrics_port))
    if config.rate_limits is not None:
        found.append(("ratelimit's metrics (--ratelimit-metrics-port)", "127.0.0.1",
                      ratelimit_metrics_port))
    return found


def port_problems(ports: list[tuple[str, str, int]]) -> list[str]:
    """Why ``up`` cannot listen on ``ports``: one taken twice, or by something running now.
    Checked before anything starts: a service's readiness wait would take whoever listens
    there for the child it started."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for what, host, port in ports:
        if port in seen:
            problems.append(f"port {port} is both {seen[port]} and {what}")
        elif listening(connect_host(host), port):
            problems.append(f"{host}:{port} ({what}) is in use already")
        seen.setdefault(port, what)
    return problems


def missing_upstream_keys(config: RoutingConfig,
                          environ: dict[str, str]) -> list[tuple[str, str]]:
    """(cluster, variable) of every ``upstream_api_key_env`` unset or empty in ``environ``:
    Envoy would send ``Bearer -`` and the pool would refuse every request."""
    return [(name, spec.upstream_api_key_env) for name, spec in config.clusters.items()
            if spec.upstream_api_key_env and not environ.get(spec.upstream_api_key_env)]


def start_all(config: RoutingConfig, config_path: str, workdir: str, *,
              extproc_metrics_port: int = 9101, ratelimit_metrics_port: int = 9102,
              env: dict[str, str] | None = None, log_dir: str | None = None,
              start_sims: bool = True) -> list[Child]:
    """Start every process of the gateway and wait for each to be ready.

    ``start_sims=False``: the caller runs the simulators of ``simulate:`` clusters itself
    (``up --models`` starts and stops them as models come and go).

    ``env`` (for example ``LLM_SIDECAR_REDIS_URL``, or a pool's ``upstream_api_key_env``) is
    added to the environment of extproc, ratelimit and Envoy; with ``log_dir``, Envoy, extproc
    and ratelimit write their output to ``LOG_DIR/NAME.log`` instead of this process's
    stdout/stderr.
    """
    child_env = {**os.environ, **env} if env else None
    missing = missing_upstream_keys(config, child_env or dict(os.environ))
    if missing:
        raise SystemExit("llm-sidecar up: Envoy would send no key to "
                         + ", ".join(f"{c} (set {v})" for c, v in missing))

    def log_path(name: str) -> str | None:
        return os.path.join(log_dir, f"{name}.log") if log_dir else None

    write_all(config, workdir)
    children: list[Child] = []
    try:
        sims: list[tuple[Child, str]] = []
        for name, cluster in config.clusters.items():
            sim = cluster.simulator
            if sim is None or not start_sims:
                continue
            for endpoint in cluster.endpoints:
                host, port = parse_hostport(endpoint)
                child = start(f"sim {name}", sidecar_command(
                    "sim", "--host", host, "--port", str(port), "--name", name,
                    "--max-model-len", str(cluster.max_context), *sim.sim_flags()),
                    log_path=os.path.join(workdir, f"sim-{name}-{port}.log"))
                children.append(child)
                sims.append((child, local_url(host, port, "/health")))
        for child, health_url in sims:  # started together, waited for together
            wait_http_ok(health_url, 30, child)
        extproc = start("extproc", sidecar_command(
            "extproc", "--config", config_path, "--metrics-port", str(extproc_metrics_port)),
            env=child_env, log_path=log_path("extproc"))
        children.append(extproc)
        _wait_service(config.services.extproc, extproc)
        if config.rate_limits is not None:
            ratelimit = start("ratelimit", sidecar_command(
                "ratelimit", "--config", config_path,
                "--metrics-port", str(ratelimit_metrics_port)),
                env=child_env, log_path=log_path("ratelimit"))
            children.append(ratelimit)
            _wait_service(config.services.ratelimit, ratelimit)
        envoy = start("envoy", [envoy_binary(), "-c", os.path.join(workdir, "envoy.yaml"),
                                "--log-level", "warn", "--disable-hot-restart",
                                # sse_to_metadata's API is marked work in progress: Envoy
                                # warns so at every start, 7 lines before the URL (why we use
                                # it: docs/decisions/0006-lua-usage-strip.md).
                                "--component-log-level", "misc:error"],
                      env=child_env, log_path=log_path("envoy"))
        children.append(envoy)
        admin_host, admin_port = parse_hostport(config.envoy.admin)
        wait_http_ok(local_url(admin_host, admin_port, "/ready"), 30, envoy)
    except BaseException:
        stop_all(children)
        raise
    return children


def stop_all(children: list[Child]) -> None:
    """Envoy first (no new traffic), then the services, then the simulators."""
    for child in reversed(children):
        child.stop()


class _Interrupted(Exception):
    """SIGINT or SIGTERM while the gateway is starting."""


def _interrupt(*_: object) -> None:
    """The first SIGINT or SIGTERM while starting: stop starting. Later ones are ignored, so
    the stopping itself is not cut short (a child left running dies with this process)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise _Interrupted


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models", None) is not None:
        from llm_sidecar.models_up import run as run_models
        return run_models(args)
    if getattr(args, "gpus", None) is not None:
        print("llm-sidecar up: --gpus describes the GPUs of --models DIR; give both",
              file=sys.stderr)
        return 2
    path = args.config or example_config_path()
    config = load_config(path)
    problems = port_problems(local_ports(config, args.extproc_metrics_port,
                                         args.ratelimit_metrics_port))
    if problems:
        for problem in problems:
            print(f"llm-sidecar up: {problem}", file=sys.stderr)
        return 1
    return serve(config.envoy.listen, lambda workdir: start_all(
        config, path, workdir, extproc_metrics_port=args.extproc_metrics_port,
        ratelimit_metrics_port=args.ratelimit_metrics_port))


def serve(listen: str, start: Callable[[str], list[Child]],
          tick: Callable[[], None] | None = None) -> int:
    """Start the gateway (``start(workdir)`` in a fresh temp dir, returning its children),
    print the URL, and serve until Ctrl-C, SIGTERM or a child's death; then stop every child.

    ``tick`` runs every half second while serving (``up --models`` watches its folder there).
    The list ``start`` returned is read again on each round: children that ``tick`` adds or
    removes from it are watched and stopped with the others."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # while starting: stop starting, at once
        signal.signal(sig, _interrupt)
    with tempfile.TemporaryDirectory(prefix="llm-sidecar-") as workdir:
        children: list[Child] = []
        try:
            children = start(workdir)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        except (_Interrupted, KeyboardInterrupt):
            stop_all(children)  # started already, if the signal came just after (else none)
            print("llm-sidecar stopped before it was up", file=sys.stderr)
            return 130
        except (RuntimeError, TimeoutError, OSError) as exc:  # a child failed to start
            print(f"llm-sidecar up: {exc}; stopped everything", file=sys.stderr)
            return 1
        host, port = parse_hostport(listen)
        print(f"llm-sidecar is up: {local_url(host, port, '/v1')} "
              f"(OpenAI API; Ctrl-C stops it)", flush=True)
        failed: Child | None = None
        while not stop.wait(0.5):
            failed = next((c for c in children if not c.alive()), None)
            if failed is not None:
                break
            if tick is not None:
                tick()
        stop_all(children)
        if failed is not None:
            print(f"llm-sidecar: {failed.name} exited with code {failed.process.returncode}; "
                  "stopped everything", file=sys.stderr)
            return 1
    print("llm-sidecar stopped", flush=True)
    return 0
