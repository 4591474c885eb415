"""A 3-master Redis Cluster behind the gateway (buckets and embedding cache), one master killed
under load: requests whose keys live on it get ``on_backend_error`` (the others are still
enforced), embeddings bypass the cache, nothing hangs or 5xxs; when the node comes back,
enforcement and the cache recover by themselves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.chaos.load import Load, percentile
from tests.chaos.support import (
    cache_probe,
    chaos_doc,
    mixed,
    rate_limit_probe,
    set_policy,
    wait_until,
)
from tests.harness.gateway import Gateway, running_gateway
from tests.harness.redis_fixtures import serving
from tests.harness.redis_servers import RedisClusterServers, start_redis_cluster

pytestmark = [pytest.mark.redis, pytest.mark.e2e]

OUTAGE_S = 2.0
"""Shorter than the cluster's node timeout (5 s): the other masters keep serving their slots.
Past it, the cluster declares itself down and every command fails (the same policy applies)."""


@dataclass
class Rig:
    gw: Gateway
    doc: dict[str, Any]
    cluster: RedisClusterServers


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with serving(start_redis_cluster, "redis cluster") as cluster:
        doc = chaos_doc()
        env = {"LLM_SIDECAR_REDIS_URL": cluster.url, "LLM_SIDECAR_DEV_MODE": "true"}
        with running_gateway(doc, str(tmp_path_factory.mktemp("chaos-cluster")), env=env,
                             capture_logs=True) as gw:
            yield Rig(gw, doc, cluster)


def consecutive(check: str, url: str, times: int) -> bool:
    return all(rate_limit_probe(url) == check for _ in range(times))


@pytest.mark.parametrize("policy", ["allow", "deny"])
def test_a_cluster_node_killed_and_back(rig: Rig, policy: str) -> None:
    gw = rig.gw
    set_policy(gw, rig.doc, policy)
    wait_until(lambda: consecutive("enforced", gw.url, 6), 10, 0.1)
    fallback = "allowed" if policy == "allow" else "denied"
    victim = rig.cluster.nodes[1]
    probes: list[str] = []
    caches: list[str] = []
    with Load(gw.url, mixed, users=4, rate_per_s=50) as load:
        time.sleep(0.5)
        killed = time.monotonic()
        victim.kill()
        while time.monotonic() - killed < OUTAGE_S:
            probes.append(rate_limit_probe(gw.url))
            caches.append(cache_probe(gw.url))
        victim.start()  # same port and nodes.conf: it rejoins with its slots, empty
        # A restarted master refuses commands (CLUSTERDOWN) until its cluster state is ok
        # again, at least 2 s (Redis's CLUSTER_WRITABLE_DELAY): Redis is back from then on.
        rejoined = wait_until(lambda: cluster_ok(victim), 15, 0.02)
        back = time.monotonic()
        recovered = wait_until(lambda: consecutive("enforced", gw.url, 10), 10, 0.02)
        time.sleep(0.5)
        ended = time.monotonic()
    during = load.between(killed, back)
    after = load.between(back + recovered, ended)
    print(f"\n[chaos] redis cluster, 1 of 3 masters killed for {OUTAGE_S:g} s, "
          f"on_backend_error={policy}: probes {dict(sorted(_count(probes).items()))}, cache "
          f"{dict(sorted(_count(caches).items()))}, p99 "
          f"{percentile([r.latency for r in during], 99) * 1000:.0f} ms; node writable "
          f"{rejoined:.2f} s after its restart, enforcing everywhere {recovered:.2f} s later")
    # A probe whose two requests straddle the breaker opening (other keys' failures open it
    # for every key) or closing gets one answer from Redis and one from the policy.
    straddled = {"unexpected ((200, None), (503, 'upstream_unavailable'))",
                 "unexpected ((503, 'upstream_unavailable'), (200, None))"}
    assert set(probes) <= {"enforced", fallback, *straddled}, probes
    assert fallback in probes, "no probe landed on the dead node's slots"
    assert set(caches) <= {"hit", "miss", "bypass"} | (
        {"status 503 upstream_unavailable"} if policy == "deny" else set()), caches
    allowed = {(200, None)} | ({(503, "upstream_unavailable")} if policy == "deny" else set())
    assert {(r.status, r.code) for r in during} <= allowed
    assert max(r.latency for r in during + after) < 2.0, "a request hung"
    assert after and {(r.status, r.code) for r in after} == {(200, None)}
    assert recovered <= 2.0


def cluster_ok(node: Any) -> bool:
    try:
        with node.client(socket_timeout=0.5, decode_responses=True) as client:
            return bool(client.cluster("INFO").get("cluster_state") == "ok")
    except Exception:  # still starting
        return False


def _count(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out
