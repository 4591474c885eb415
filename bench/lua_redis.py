"""Redis CPU per script call for the gateway's shape, from ``INFO commandstats``.

    .venv/bin/python -m bench.lua_redis [--requests 4000] [--scripts path/to/lua.py]

One request = the admission ``EVALSHA`` of 6 hits (3 requests buckets with hits 1, 3 token
buckets reserving 100 tokens under a lease, each with its marker key) and a settlement of its 3
token items (64 used). Decisions and settlements run as separate phases so each has its own
``usec_per_call``. ``--scripts`` loads ``DECIDE`` and ``SETTLE`` from another copy of
``ratelimit/lua.py`` (e.g. one from an older commit), to A/B two versions on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import redis

from tests.harness.redis_servers import start_redis

BUCKETS = ("rl:{a}:req", "rl:{t}:req", "rl:{m}:req", "rl:{a}:tok", "rl:{t}:tok", "rl:{m}:tok")
BIG = "1000000000"


def load_scripts(path: str | None) -> ModuleType:
    if path is None:
        import ratelimit.lua
        return ratelimit.lua
    spec = importlib.util.spec_from_file_location("bench_lua_scripts", Path(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request_keys(lease: str) -> list[str]:
    return [*BUCKETS, *(f"{bucket}:lease:{lease}" for bucket in BUCKETS[3:])]


def decide_args(lease: str) -> list[str]:
    args = ["1000", "6", "600000"]
    for k in range(1, 4):
        args += [str(k), BIG, BIG, "0", "1", "0", ""]
    for k in range(4, 7):
        args += [str(k), BIG, BIG, "0", "100", str(k + 3), lease]
    return args


def settle_args(lease: str) -> list[str]:
    args = ["1000", "3"]
    for k in range(4, 7):
        args += [str(k), BIG, BIG, "64", str(k + 3), lease]
    return args


def usec_per_call(client: redis.Redis) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--scripts", help="a copy of ratelimit/lua.py to measure instead")
    options = parser.parse_args()
    lua = load_scripts(options.scripts)
    server = start_redis(allow_external=False)
    try:
        client = redis.Redis(host=server.host, port=server.port)
        decide, settle = client.script_load(lua.DECIDE), client.script_load(lua.SETTLE)
        leases = [f"{i:024x}" for i in range(options.requests)]
        client.config_resetstat()
        for lease in leases:
            keys = request_keys(lease)
            client.evalsha(decide, len(keys), *keys, *decide_args(lease))
        decided = usec_per_call(client)
        client.config_resetstat()
        for lease in leases:
            keys = request_keys(lease)
            client.evalsha(settle, len(keys), *keys, *settle_args(lease))
        settled = usec_per_call(client)
        assert client.dbsize() == len(BUCKETS), "every marker settled"
        print(f"DECIDE {decided:.1f} µs/call, SETTLE {settled:.1f} µs/call, "
              f"Redis µs/request {decided + settled:.1f} ({options.requests} requests)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
