"""Waiting until the running gateway has taken a change of ``llm-sidecar up --models``: Envoy
serving the new pool files (its admin ``/config_dump`` and ``/clusters``) and extproc and
ratelimit having reloaded the routing YAML (their ``PREFIX_config_reloads_total`` counters).

Each wait polls and gives up after a timeout rather than raising: the caller says what did not
happen in time and goes on, since the change is already written and will be taken late."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Collection, Sequence

from routing.units import join_hostport, parse_hostport
from sidecar_runtime.process.procs import poll_until

ANSWER_ERRORS = (OSError, ValueError, KeyError)
"""What counts as "not yet" while polling: no answer, or an answer not (yet) of the shape read."""


def admin_get(admin: str, path: str) -> str:
    """The text Envoy's admin listener at ``admin`` (``host:port``) answers for ``path``."""
    host, port = parse_hostport(admin)
    with urllib.request.urlopen(f"http://{join_hostport(host, port)}{path}", timeout=2) as resp:
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


def reloads(metrics_url: str, prefix: str) -> float:
    """:func:`reload_count`, or -1 while the service does not answer (so any count it reports
    later is above it)."""
    try:
        return reload_count(metrics_url, prefix)
    except (OSError, ValueError):
        return -1.0


def wait_envoy_applied(admin: str, version: str, healthy: Collection[tuple[str, str]],
                       gone: Collection[str], timeout_s: float) -> bool:
    """Until Envoy at ``admin`` serves routes of ``version``, counts each (cluster, endpoint) of
    ``healthy`` healthy and lists no cluster of ``gone``; False on timeout."""
    def applied() -> bool:
        hosts = envoy_hosts(admin)
        return (envoy_routes_version(admin) == version
                and all(e in hosts.get(c, set()) for c, e in healthy)
                and not set(gone) & set(hosts))
    return poll_until(applied, timeout_s, errors=ANSWER_ERRORS)


def reload_counts(metrics: Sequence[tuple[str, str]]) -> list[float]:
    """:func:`reloads` of each (``/metrics`` URL, prefix) of ``metrics``."""
    return [reloads(url, prefix) for url, prefix in metrics]


def wait_reloaded(metrics: Sequence[tuple[str, str]], before: Sequence[float], timeout_s: float) -> bool:
    """Until every service of ``metrics`` counts more reloads than ``before`` (from
    :func:`reload_counts`); False on timeout."""
    return poll_until(lambda: all(reloads(url, prefix) > count
                                  for (url, prefix), count in zip(metrics, before, strict=True)),
                      timeout_s, errors=ANSWER_ERRORS)
