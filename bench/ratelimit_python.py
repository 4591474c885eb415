"""``python -m bench.ratelimit_python``: the Python a rate-limit decision costs, stage by stage.

One admission as the gateway sends it (bench/front.py's routing YAML: requests and tokens limits
on api_key, tenant and model, so 6 descriptors, 3 with a lease and a reservation), through
the service's own functions with no I/O: parse (upb), ``request_from_proto``, ``plan`` (matching
afresh, and with the :class:`~ratelimit.limiter.Matches` a Limiter keeps), ``resolve``,
``response_to_proto`` and its serialisation. CPU time per call (``time.process_time``), the
minimum of the rounds: on a shared machine the minimum is the better guide to what code costs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from types import MappingProxyType

import yaml
from envoy.service.ratelimit.v3 import rls_pb2

from bench import bodies, front
from bench.paced import POOLS
from ratelimit.bucket import BucketResult
from ratelimit.descriptors import RateLimitConfig
from ratelimit.from_routing import compile_rate_limits
from ratelimit.limiter import Matches, plan, resolve
from ratelimit.store import StoreResult
from ratelimit.wire import request_from_proto, response_to_proto
from routing.loader import load_config
from routing.ratelimits import DOMAIN
from sidecar_runtime.wire_names import LEASE_ENTRY


def _config() -> RateLimitConfig:
    doc = front.routing_doc(listen=1, admin=2, extproc=3, ratelimit=4, upstream=(5, 6, 7),
                            paced={pool.cluster: 8 for pool in POOLS})
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(doc, handle)
    try:
        config = load_config(handle.name)
    finally:
        os.unlink(handle.name)
    return RateLimitConfig(MappingProxyType({DOMAIN: compile_rate_limits(config)}))


def admission() -> bytes:
    """The serialised RLS request of one admission (requests, then tokens, per level)."""
    message = rls_pb2.RateLimitRequest(domain=DOMAIN)
    levels = (("api_key", "k_0123456789abcdef01234567"), ("tenant", "acme"),
              ("model", bodies.MODEL))
    for kind in ("requests", "tokens"):
        for level, value in levels:
            descriptor = message.descriptors.add()
            for key, text in (("kind", kind), (level, value)):
                entry = descriptor.entries.add()
                entry.key, entry.value = key, text
            if kind == "tokens":
                entry = descriptor.entries.add()
                entry.key, entry.value = LEASE_ENTRY, "0123456789abcdef01234567"
                descriptor.hits_addend.value = 120
    raw: bytes = message.SerializeToString()
    return raw


def _time(fn: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ratelimit_python",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config, raw, matches = _config(), admission(), Matches()
    message = rls_pb2.RateLimitRequest.FromString(raw)
    request = request_from_proto(message)
    planned = plan(config, request, matches)
    stored = StoreResult(True, tuple(BucketResult(True, 100.0) for _ in planned.hits))
    outcome = resolve(planned, stored)
    stages: list[tuple[str, Callable[[], object]]] = [
        ("parse (upb)", lambda: rls_pb2.RateLimitRequest.FromString(raw)),
        ("request_from_proto", lambda: request_from_proto(message)),
        ("plan, matched afresh", lambda: plan(config, request)),
        ("plan, remembered matches", lambda: plan(config, request, matches)),
        ("resolve", lambda: resolve(planned, stored)),
        ("response_to_proto + serialise", lambda: response_to_proto(outcome).SerializeToString()),
    ]
    print(f"one admission: {len(message.descriptors)} descriptors, {len(planned.hits)} buckets")
    print("| stage | µs CPU per call (min of rounds) |\n|---|---|")
    for name, fn in stages:
        print(f"| {name} | {_time(fn, args.calls, args.rounds):.1f} |")


if __name__ == "__main__":
    main()
