"""Filesystem xDS (``envoy.dynamic_pools: true``): the pools' clusters and routes in files Envoy
watches, so a pool added, changed or removed reaches a running Envoy without a restart.

Layout, beside the bootstrap: ``xds/cds.yaml`` (every pool cluster) and ``xds/rds.yaml`` (the
route configuration of the listener). Each file is a discovery response (``version_info`` and
``resources``). The bootstrap points at them with a ``path_config_source`` whose
``watched_directory`` is ``xds/``: Envoy then reloads a file whenever an entry is *moved into*
that folder, never on a write in place (a half-written file would be read otherwise; checked
with Envoy 1.40: a file rewritten in place was still not applied seconds later, a renamed one
was applied within tens of milliseconds). So every file is written under a scratch name in the
same folder and renamed over the old one (:func:`sidecar_runtime.process.files.replace_file`).
The extproc and ratelimit clusters stay in the bootstrap: they do not change with the pools.

``version_info`` is a hash of the resources, so a caller can read Envoy's ``/config_dump`` and
know when the file it wrote is the one in use.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

XDS_DIR = "xds"
"""The folder of the watched files, relative to the bootstrap's folder."""
CDS_FILE = "cds.yaml"
RDS_FILE = "rds.yaml"
CDS_PATH = f"{XDS_DIR}/{CDS_FILE}"
RDS_PATH = f"{XDS_DIR}/{RDS_FILE}"
ROUTE_CONFIG_NAME = "llm"

XDS_NODE = {"id": "llm-sidecar", "cluster": "llm-sidecar"}
"""The bootstrap's ``node`` with dynamic pools (Envoy needs one to subscribe to anything)."""

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"

FINGERPRINT_DIR = "/xds"
"""The folder the bootstrap fingerprint is computed with: extproc computes it too, from the
routing YAML alone, without knowing where ``render`` wrote the files."""


def path_source(xds_dir: str, name: str) -> dict[str, Any]:
    """A config source reading ``xds_dir/name``, reloaded on a move into ``xds_dir``."""
    return {
        "path_config_source": {"path": os.path.join(xds_dir, name),
                               "watched_directory": {"path": xds_dir}},
        "resource_api_version": "V3",
    }


def dynamic_resources(xds_dir: str) -> dict[str, Any]:
    """The bootstrap's ``dynamic_resources``: clusters from ``xds_dir/cds.yaml``."""
    return {"cds_config": path_source(xds_dir, CDS_FILE)}


def rds(xds_dir: str) -> dict[str, Any]:
    """The connection manager's ``rds``: its routes from ``xds_dir/rds.yaml``."""
    return {"route_config_name": ROUTE_CONFIG_NAME, "config_source": path_source(xds_dir, RDS_FILE)}


def resources_version(resources: list[dict[str, Any]]) -> str:
    """The ``version_info`` of a file holding ``resources``: the same resources, the same
    version, whatever their order."""
    text = json.dumps(sorted(resources, key=lambda r: str(r.get("name", ""))), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def discovery_document(type_url: str, resources: list[dict[str, Any]]) -> dict[str, Any]:
    """A file Envoy's filesystem subscription reads: a ``DiscoveryResponse`` in YAML."""
    typed = [{"@type": type_url, **resource} for resource in resources]
    return {"version_info": resources_version(typed), "resources": typed}


def cds_document(pool_clusters: list[dict[str, Any]]) -> dict[str, Any]:
    return discovery_document(CLUSTER_TYPE, pool_clusters)


def rds_document(route_config: dict[str, Any]) -> dict[str, Any]:
    return discovery_document(ROUTE_TYPE, [route_config])
