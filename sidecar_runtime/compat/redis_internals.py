"""redis-py internals our own connection and cluster router use (redis>=5.2,<9).

- ``BaseParser.parse_error`` and ``Encoder``: the connection of :mod:`sidecar_runtime.redis.conn`
  parses replies with ``hiredis`` itself and turns errors into redis-py's exceptions exactly as
  redis-py's own parser does, so callers see one set of exceptions.
- ``NodesManager.slots_cache``: the cluster router (:mod:`sidecar_runtime.redis.cluster`) reads
  redis-py's slot map to know which masters own slots and whether a ``CLUSTER SLOTS`` reply
  differs from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from redis._parsers.base import BaseParser
    from redis._parsers.encoders import Encoder
    from redis.asyncio.cluster import ClusterNode, NodesManager
except ImportError as exc:  # pragma: no cover - only on a redis-py that moved them
    raise ImportError(f"redis-py moved {exc.name}: sidecar_runtime.redis needs the internals of "
                      "redis>=5.2,<9 (pyproject.toml)") from exc

if not hasattr(NodesManager, "__init__") or "slots_cache" not in NodesManager.__init__.__code__.co_names:
    raise ImportError("redis-py's NodesManager no longer keeps slots_cache: "  # pragma: no cover
                      "sidecar_runtime.redis.cluster needs redis>=5.2,<9 (pyproject.toml)")

__all__ = ["BaseParser", "Encoder", "slot_owners"]


def slot_owners(nodes: NodesManager) -> Mapping[int, list[ClusterNode]]:
    """redis-py's current slot map: slot number to its nodes, the master first."""
    owners: Any = nodes.slots_cache
    return owners  # type: ignore[no-any-return]
