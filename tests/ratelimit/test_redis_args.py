"""The script arguments :class:`~ratelimit.redis_store.RedisStore` sends, recorded without a
Redis: the text it remembers per bucket spec is the text made afresh, for every spec it meets,
and what it remembers stays bounded."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from ratelimit import redis_store
from ratelimit.bucket import BucketSpec, Hit, Settle
from ratelimit.lua import DECIDE_SHA, SETTLE_SHA
from ratelimit.redis_store import RedisStore

LEASE = "lease-0123456789"


class Recorder(RedisStore):
    """Records each script call and answers as if every bucket admitted at level 1.5."""

    def __init__(self) -> None:
        super().__init__(Redis(), margin_s=1.0, lease_ttl_s=600.0)  # never connects
        self.sent: list[tuple[Any, ...]] = []

    async def _command(self, key: str, *command: Any) -> Any:
        self.sent.append(command)
        return [1, *[x for _ in range(64) for x in (1, b"1.5")]]


def spec_args(spec: BucketSpec) -> list[str]:
    """capacity, rate and flags, made afresh as the scripts read them."""
    flags = (1 if spec.debt else 0) | (2 if spec.shadow else 0) | (4 if spec.concurrent else 0)
    return [repr(spec.capacity), repr(spec.rate), str(flags)]


SPECS = {
    "float": BucketSpec(10.0, 1 / 3),
    "ints, as a caller may pass them": BucketSpec(5, 2),
    "the same numbers as floats": BucketSpec(5.0, 2.0),
    "debt": BucketSpec(1e9, 1e6 / 7, debt=True),
    "shadow concurrent": BucketSpec(3.0, 0.0, shadow=True, concurrent=True),
    "huge": BucketSpec(1.7976931348623157e308, 5e-324),
}


@pytest.mark.parametrize("name", list(SPECS))
async def test_a_decision_sends_each_specs_own_text(name: str) -> None:
    store = Recorder()
    spec = SPECS[name]
    for _ in range(3):  # remembered from the second call on: the same text
        for other in SPECS.values():  # equal specs (5 and 5.0) keep their own text
            await store.decide([Hit("rl:{a}", other, 1)])
        await store.decide([Hit("rl:{a}", spec, 4, LEASE), Hit("rl:{b}", spec, 0)])
        *_, command = store.sent
        assert command[0] == "EVALSHA" and command[1] == DECIDE_SHA
        keys, args = command[3:3 + command[2]], command[3 + command[2]:]
        reserves = not spec.debt and not spec.concurrent  # its marker key comes third
        assert list(keys) == ["rl:{a}", "rl:{b}"] + (["rl:{a}:lease:" + LEASE] if reserves else [])
        marker = ["3" if reserves else "0"]
        assert list(args[3:10]) == ["1", *spec_args(spec), "4", *marker, LEASE]


async def test_settlements_send_the_same_text() -> None:
    store = Recorder()
    for spec in SPECS.values():
        await store.settle([Settle("rl:{a}", spec, LEASE, 7), Settle("rl:{c}", spec, LEASE, None)])
        _, sha, nkeys, *rest = store.sent[-1]
        assert sha == SETTLE_SHA and nkeys == 3  # two buckets and the first one's marker
        args = rest[3:]
        assert args[3:6] == [*spec_args(spec)[:2], "7"]
        assert args[9:12] == [*spec_args(spec)[:2], "-1"]


async def test_what_is_remembered_stays_bounded_and_right_past_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "MAX_SPEC_TEXTS", 8)
    store = Recorder()
    specs = [BucketSpec(float(n), n / 10) for n in range(1, 40)]  # as many limits as a reload
    for spec in [*specs, *reversed(specs)]:
        await store.decide([Hit("rl:{a}", spec, 1)])
        assert list(store.sent[-1][-6:-3]) == spec_args(spec)
        assert len(store._spec_texts) <= 8


async def test_a_spec_at_the_id_of_a_forgotten_one_gets_its_own_text() -> None:
    store = Recorder()
    first = BucketSpec(1.0, 1.0)
    await store.decide([Hit("rl:{a}", first, 1)])
    # What an id reused after the first spec was gone would look like: a stale entry.
    other = BucketSpec(2.0, 0.5, shadow=True)
    store._spec_texts[id(other)] = store._spec_texts.pop(id(first))
    await store.decide([Hit("rl:{a}", other, 1)])
    assert list(store.sent[-1][-6:-3]) == spec_args(other)
