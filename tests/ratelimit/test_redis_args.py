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

    async def _command(self, key: str, *command: Any, late: Any = None) -> Any:
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


def reference_group(hits: list[Hit], positions: tuple[int, ...]) -> redis_store._Group:
    """The KEYS and their indexes as the store has always sent them: the buckets in order of
    first use, then the reservation markers; per hit its bucket's index and its marker's ("0":
    none; an empty lease's marker key is sent but not used)."""
    keys: dict[str, int] = {}
    for i in positions:
        keys.setdefault(hits[i].key, len(keys) + 1)
    markers: list[int] = []
    for i in positions:
        hit = hits[i]
        reserves = (hit.lease is not None and not hit.spec.concurrent and not hit.spec.debt
                    and hit.hits > 0)
        if reserves and hit.lease is not None:
            index = keys.setdefault(redis_store.marker_key(hit.key, hit.lease), len(keys) + 1)
            markers.append(index if hit.lease else 0)
        else:
            markers.append(0)
    refs = tuple((str(keys[hits[i].key]), str(marker))
                 for i, marker in zip(positions, markers, strict=True))
    return redis_store._Group(positions, tuple(keys), refs)


TOKEN, DEBT, SLOTS = BucketSpec(100.0, 1.0), BucketSpec(100.0, 1.0, debt=True), \
    BucketSpec(3.0, 0.0, concurrent=True)
GROUPS: dict[str, list[Hit]] = {
    "an admission": [Hit("rl:{r1}", TOKEN, 1), Hit("rl:{r2}", TOKEN, 1), Hit("rl:{r3}", TOKEN, 1),
                     Hit("rl:{t1}", TOKEN, 120, LEASE), Hit("rl:{t2}", TOKEN, 120, LEASE),
                     Hit("rl:{t3}", TOKEN, 120, LEASE)],
    "a bucket twice, leased twice": [Hit("rl:{a}", TOKEN, 5, LEASE), Hit("rl:{a}", TOKEN, 7, LEASE),
                                     Hit("rl:{b}", TOKEN, 1), Hit("rl:{a}", TOKEN, 1)],
    "no marker: debt, slots, zero hits, no lease": [
        Hit("rl:{d}", DEBT, 5, LEASE), Hit("rl:{s}", SLOTS, 1, LEASE), Hit("rl:{z}", TOKEN, 0, LEASE),
        Hit("rl:{n}", TOKEN, 3)],
    "an empty lease: its marker key sent, not used": [Hit("rl:{e}", TOKEN, 2, ""),
                                                      Hit("rl:{f}", TOKEN, 2, LEASE)],
    "a hundred buckets (indexes past the table)": [
        Hit(f"rl:{{k{n}}}", TOKEN, n % 3, LEASE if n % 2 else None) for n in range(100)],
}


@pytest.mark.parametrize("name", list(GROUPS))
def test_a_group_names_its_keys_as_the_store_always_has(name: str) -> None:
    hits = GROUPS[name]
    for positions in (tuple(range(len(hits))), tuple(range(0, len(hits), 2)),
                      tuple(range(len(hits) - 1, -1, -1))):
        assert redis_store._group(hits, positions) == reference_group(hits, positions)
