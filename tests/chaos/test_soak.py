"""The soak scaled down for CI (the full 200,000-request run: ``python -m tests.chaos.soak``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.soak import SERVICES, run_soak, soak_gateway
from tests.harness.ci import unavailable
from tests.harness.gateway import Gateway
from tests.harness.redis_servers import redis_binary

pytestmark = [pytest.mark.redis, pytest.mark.e2e]
REQUESTS = 5000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    if redis_binary() is None:
        unavailable("redis")
    with soak_gateway(str(tmp_path_factory.mktemp("soak"))) as gateway:
        yield gateway


def test_soak_memory_and_descriptors_stay_flat(gw: Gateway) -> None:
    result = run_soak(gw, REQUESTS)
    print("\n[chaos] " + result.report())
    assert sum(result.outcomes.values()) == REQUESTS
    assert {k.split()[1] for k in result.outcomes} <= {"200", "429"}, result.outcomes
    assert result.outcomes["chat 429"] > 0 and result.outcomes["stream 200"] > 0
    for service in SERVICES:
        for what in ("rss", "fds"):
            assert not result.grew(service, what), (service, what, result.report())
