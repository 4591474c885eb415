"""The leaner scripts against the ones released before them, on one real Redis: for random
sequences of decisions, settlements and refunds, the new scripts, the old ones, and the two
interleaved (a rolling upgrade: replicas of both versions sharing the keys) give the same
replies, the same bucket hashes (levels to the ``%.17g`` text), slots, markers and TTLs.

Both versions read the clock from a key instead of ``TIME`` (the one line replaced), so every
namespace sees the same instants."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from ratelimit import lua as new_lua
from tests.harness.redis_servers import RedisServer
from tests.integration import lua_before_issue16 as old_lua

pytestmark = pytest.mark.redis

TIME = "local t = redis.call('TIME')"
CLOCK = "local t = redis.call('HMGET', 'clock', 's', 'us')"
MARGIN_MS = "60000"  # no key expires by the real clock during a test
BUCKETS = ("r1", "r2", "t1", "t2", "c1")
SPECS = {"r1": ("5", "0.5", 0), "r2": ("3", "0.25", 2), "t1": ("1000", "10", 0),
         "t2": ("300", "3.3333333333333335", 1), "c1": ("2", "0", 4)}


def clocked(module: ModuleType, name: str) -> str:
    script: str = getattr(module, name)
    assert script.count(TIME) == 1
    return script.replace(TIME, CLOCK)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_server.url, decode_responses=True)
    made.flushall()
    try:
        yield made
    finally:
        made.close()


class Op:
    """One script call, as KEYS (bucket names and marker names) and ARGV, in any namespace."""

    def __init__(self, name: str, keys: list[str], args: list[str]) -> None:
        self.name, self.keys, self.args = name, keys, args

    def run(self, client: redis.Redis, module: ModuleType, space: str) -> Any:
        keys = [f"{space}:{{{k}}}" if ":" not in k else f"{space}:{{{k.split(':')[0]}}}:lease:"
                f"{k.split(':')[1]}" for k in self.keys]
        return client.eval(clocked(module, self.name), len(keys), *keys, *self.args)


def random_op(rng: random.Random, leases: list[str]) -> Op:
    kind = rng.random()
    if kind < 0.6 or not leases:
        lease = f"L{rng.randrange(10**6)}"
        names = rng.choices(BUCKETS, k=rng.randint(1, 6))
        keys: list[str] = []
        args = [MARGIN_MS, str(len(names)), "600000"]
        for name in names:
            if name not in keys:
                keys.append(name)
        for name in names:
            capacity, rate, flags = SPECS[name]
            hits = rng.choice([0, 1, 1, 2, 40, 150])
            marker = 0
            use_lease = (name.startswith("t") and flags == 0) or name.startswith("c")
            if use_lease and name.startswith("t") and hits > 0:
                keys.append(f"{name}:{lease}")
                marker = len(keys)
                leases.append(f"{name}:{lease}")
            args += [str(keys.index(name) + 1), capacity, rate, str(flags), str(hits), str(marker),
                     lease if use_lease else ""]
        if kind < 0.1:  # the refund of a group another slot denied
            refund = [MARGIN_MS, str(len(names))]
            for n, name in enumerate(names):
                capacity, rate, flags = SPECS[name]
                refund += [args[3 + 7 * n], capacity, rate, args[3 + 7 * n + 4], str(flags),
                           args[3 + 7 * n + 5], args[3 + 7 * n + 6]]
            return Op("REFUND", keys, refund)
        return Op("DECIDE", keys, args)
    items = rng.sample(leases, k=min(len(leases), rng.randint(1, 3)))
    keys, args = [], [MARGIN_MS, str(len(items))]
    for item in items:
        bucket = item.split(":")[0]
        capacity, rate, _ = SPECS[bucket]
        keys += [bucket, item]
        args += [str(len(keys) - 1), capacity, rate, str(rng.choice([0, 10, 100, 500])),
                 str(len(keys)), item.split(":")[1]]
    return Op("SETTLE", keys, args)


def state(client: redis.Redis, space: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in client.scan_iter(f"{space}:*"):
        name = key[len(space) + 1:]
        kind = client.type(key)
        if kind == "hash":
            value: Any = client.hgetall(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            value = client.get(key)
        found[name] = (value, client.pttl(key))
    return found


def same_ttls(a: dict[str, Any], b: dict[str, Any], slack_ms: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        assert abs(a[name][1] - b[name][1]) <= slack_ms, name


@pytest.mark.parametrize("seed", range(6))
def test_old_new_and_interleaved_scripts_agree(client: redis.Redis, seed: int) -> None:
    rng = random.Random(seed)
    leases: list[str] = []
    now_us = 1_764_000_000_000_000
    longest_ms = 0.0
    for _ in range(120):
        now_us += rng.choice([0, 1, 999, 250_000, 3_000_000])
        client.hset("clock", mapping={"s": now_us // 1_000_000, "us": now_us % 1_000_000})
        op = random_op(rng, leases)
        started = time.monotonic()
        old = op.run(client, old_lua, "old")
        new = op.run(client, new_lua, "new")
        mixed = op.run(client, rng.choice([old_lua, new_lua]), "mix")
        assert new == old and mixed == old, (op.name, op.args)
        views = {space: state(client, space) for space in ("old", "new", "mix")}
        # TTLs are set relative to Redis's real clock: a key's copies were set within one op
        # (perhaps an earlier, slower one) and are read within this one, so they are apart by at
        # most the longest op so far plus this one, plus PTTL's rounding.
        this_ms = (time.monotonic() - started) * 1000
        longest_ms = max(longest_ms, this_ms)
        slack_ms = longest_ms + this_ms + 2
        same_ttls(views["old"], views["new"], slack_ms)
        same_ttls(views["old"], views["mix"], slack_ms)
