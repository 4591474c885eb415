"""The rate limiter's own pipelined Redis connections against a real Redis: each caller gets
its own reply (or its own error) in every RESP shape the scripts return, under bursts and
cancellations, across Redis dying, restarting and freezing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvloop
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit.bucket import BucketSpec, Hit
from ratelimit.redis_store import RedisStore
from sidecar_runtime.process.procs import free_port
from sidecar_runtime.redis import batch as redis_batch
from sidecar_runtime.redis.batch import CommandBatcher
from sidecar_runtime.redis.client import make_client
from sidecar_runtime.redis.conn import RespConnection
from tests.harness.redis_servers import RedisServer
from tests.harness.waits import until

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    made = make_client(redis_server.url, 1.0)
    assert isinstance(made, Redis)
    yield made
    await made.aclose()


@pytest.fixture
async def batcher(client: Redis) -> AsyncIterator[CommandBatcher]:
    made = CommandBatcher(client)
    yield made
    await made.aclose()


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The size of every write the connections make (handshakes included)."""
    sizes: list[int] = []
    original = RespConnection._write

    def counted(self: RespConnection, data: bytes, idle: bool) -> None:
        sizes.append(data.count(b"*"))  # one array header per command (no '*' in these args)
        original(self, data, idle)

    monkeypatch.setattr(RespConnection, "_write", counted)
    yield sizes


SCRIPT_REPLIES: list[tuple[str, Any]] = [
    ("return 42", 42),
    ("return -7", -7),
    ("return 3.9", 3),  # Lua numbers come back as integers, truncated
    ("return 'a bulk string'", b"a bulk string"),
    ("return ''", b""),
    ("return false", None),  # nil
    ("return {}", []),
    ("return {1, 'two', {3, {'four'}}, false}", [1, b"two", [3, [b"four"]], None]),  # false: nil
    ("return redis.status_reply('FINE')", b"FINE"),
    ("return {1, 0.5, '1.5'}", [1, 0, b"1.5"]),  # the decide script's shape: levels as strings
]


@pytest.mark.parametrize(("script", "expected"), SCRIPT_REPLIES, ids=[s for s, _ in SCRIPT_REPLIES])
async def test_every_reply_shape_a_script_returns(batcher: CommandBatcher, script: str,
                                                 expected: Any) -> None:
    assert await batcher.execute("EVAL", script, 0) == expected


async def test_error_replies_raise_what_redis_py_raises_and_only_for_their_command(
        batcher: CommandBatcher) -> None:
    results = await asyncio.gather(
        batcher.execute("SET", "a", "1"),
        batcher.execute("EVALSHA", "0" * 40, 0),  # no such script: the store falls back to EVAL
        batcher.execute("EVAL", "return redis.error_reply('MYERR went wrong')", 0),
        batcher.execute("EVAL", "return {1, redis.error_reply('NESTED bad')}", 0),
        batcher.execute("INCR", "a"),
        return_exceptions=True)
    assert results[0] == b"OK"
    assert isinstance(results[1], NoScriptError)
    assert isinstance(results[2], ResponseError) and not isinstance(results[2], NoScriptError)
    assert str(results[2]) == "MYERR went wrong"
    nested = results[3]
    assert isinstance(nested, list) and nested[0] == 1 and isinstance(nested[1], ResponseError)
    assert results[4] == 2


async def test_arguments_are_encoded_as_redis_py_encodes_them(batcher: CommandBatcher) -> None:
    echo = "return ARGV"
    got = await batcher.execute("EVAL", echo, 0, "é", b"\x00\xff", 7, -2, 0.1, 1e20,
                                bytearray(b"ba"), memoryview(b"mv"))
    assert got == ["é".encode(), b"\x00\xff", b"7", b"-2", b"0.1", b"1e+20", b"ba", b"mv"]
    with pytest.raises(DataError):
        await batcher.execute("SET", "k", True)
    assert batcher.in_flight == 0  # a refused argument takes no slot


async def test_commands_of_one_iteration_leave_in_one_write(batcher: CommandBatcher,
                                                           writes: list[int]) -> None:
    await batcher.execute("PING")  # connected (no AUTH/SELECT on this server: db 0)
    writes.clear()
    replies = await asyncio.gather(*(batcher.execute("INCRBY", "n", i) for i in range(1, 51)))
    assert writes == [50]
    # Each caller got the reply to its own command, in the order Redis ran them.
    assert replies == [sum(range(1, i + 1)) for i in range(1, 51)]
    assert await batcher.execute("PING") == b"PONG"
    assert writes == [50, 1]  # a lone command: a write of its own


async def test_500_concurrent_commands_each_get_their_own_reply_and_the_bound_holds(
        client: Redis) -> None:
    bound = 16
    batcher = CommandBatcher(client, max_in_flight=bound)
    seen: list[int] = []

    async def call(i: int) -> tuple[Any, Any]:
        seen.append(batcher.in_flight)
        if i % 2:
            return await batcher.execute("ECHO", f"caller-{i}"), f"caller-{i}".encode()
        return await batcher.execute("INCRBY", f"own-{i}", i), i

    async def sample() -> None:
        while True:
            seen.append(batcher.in_flight)
            await asyncio.sleep(0)

    sampler = asyncio.ensure_future(sample())
    try:
        pairs = await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(500))), 30)
    finally:
        sampler.cancel()
        await batcher.aclose()
    assert all(got == expected for got, expected in pairs)
    assert max(seen) == bound  # the burst waited for slots (and never failed)
    assert batcher.in_flight == 0


async def test_the_default_bound_is_the_store_s_old_one() -> None:
    assert redis_batch.MAX_IN_FLIGHT == 128


@pytest.mark.parametrize("leaver", [0, 2])
async def test_a_caller_that_gives_up_before_the_write_is_not_sent(
        batcher: CommandBatcher, leaver: int) -> None:
    await batcher.execute("PING")
    calls = [asyncio.ensure_future(batcher.execute("INCR", "c")) for _ in range(4)]
    await asyncio.sleep(0)  # every call has queued its command; the write is due
    calls[leaver].cancel()
    others = [call for n, call in enumerate(calls) if n != leaver]
    results = await asyncio.wait_for(asyncio.gather(*others), 5)
    assert sorted(results) == [1, 2, 3]  # the cancelled one was dropped before it was sent
    assert calls[leaver].cancelled() and batcher.in_flight == 0


async def test_a_caller_cancelled_after_its_command_was_sent_leaves_the_others_in_step(
        batcher: CommandBatcher, client: Redis) -> None:
    """Its reply arrives later and is dropped: the next replies still go to their own
    callers (a FIFO off by one would hand the BLPOP's reply to the INCR)."""
    await batcher.execute("PING")
    blocked = asyncio.ensure_future(batcher.execute("BLPOP", "queue", 30))
    behind = asyncio.ensure_future(batcher.execute("INCR", "behind"))

    async def blocked_in_redis() -> bool:
        return int((await client.info("clients"))["blocked_clients"]) == 1

    await until(blocked_in_redis, timeout_s=10, what="the BLPOP to block in Redis")
    blocked.cancel()
    assert batcher.in_flight == 2  # still in flight: its reply has not been read
    await client.rpush("queue", "for-the-cancelled")
    assert await asyncio.wait_for(behind, 10) == 1
    assert blocked.cancelled()
    assert await batcher.execute("ECHO", "next") == b"next"
    assert batcher.in_flight == 0


async def test_random_cancellations_among_500_never_cross_replies(batcher: CommandBatcher) -> None:
    rng = random.Random(16)
    calls = [asyncio.ensure_future(batcher.execute("ECHO", f"c{i}")) for i in range(500)]
    for _ in range(40):
        for n in rng.sample(range(500), 5):
            calls[n].cancel()
        await asyncio.sleep(0)
    done, _ = await asyncio.wait(calls, timeout=30)
    assert len(done) == 500
    answered = [(i, call.result()) for i, call in enumerate(calls) if not call.cancelled()]
    assert answered and all(reply == f"c{i}".encode() for i, reply in answered)
    await until(lambda: batcher.in_flight == 0, timeout_s=10, what="every reply read")
    assert await batcher.execute("ECHO", "after") == b"after"


async def test_a_dead_server_fails_every_command_at_once_and_keeps_failing() -> None:
    port = free_port()
    dead = make_client(f"redis://127.0.0.1:{port}/0", 0.5)
    assert isinstance(dead, Redis)
    batcher = CommandBatcher(dead)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(batcher.execute("PING") for _ in range(4)), return_exceptions=True),
            10)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        assert f"connecting to 127.0.0.1:{port}" in str(results[0]), results[0]
        with pytest.raises(RedisConnectionError):  # a new connect, failing the same way
            await asyncio.wait_for(batcher.execute("PING"), 10)
        assert batcher.in_flight == 0
    finally:
        await batcher.aclose()
        await dead.aclose()


async def test_redis_killed_fails_what_is_in_flight_and_a_restart_reconnects(
        own_redis_server: RedisServer) -> None:
    client = make_client(own_redis_server.url, 1.0)
    assert isinstance(client, Redis)
    batcher = CommandBatcher(client)
    try:
        await batcher.execute("SET", "k", "v")
        in_flight = [asyncio.ensure_future(batcher.execute("BLPOP", "nothing", 60)),
                     *(asyncio.ensure_future(batcher.execute("ECHO", str(i))) for i in range(5))]
        await until(lambda: batcher.in_flight == 6 and not any(f.done() for f in in_flight),
                    timeout_s=5, what="the commands to be sent")
        own_redis_server.kill()
        # At once, not after the BLPOP's 60 s: the connection is gone.
        results = await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), 10)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        assert batcher.in_flight == 0
        with pytest.raises(RedisConnectionError):  # down: refused at once
            await asyncio.wait_for(batcher.execute("PING"), 10)
        own_redis_server.restart()
        assert await batcher.execute("GET", "k") is None  # reconnected (and empty)
        assert await batcher.execute("SET", "k", "again") == b"OK"
    finally:
        await batcher.aclose()
        await client.aclose()


async def until_answers(batcher: CommandBatcher) -> None:
    """``PING`` until one is answered (within 10 s)."""
    async def answered() -> bool:
        try:
            return bool(await batcher.execute("PING"))
        except (RedisConnectionError, RedisTimeoutError):
            return False
    await until(answered, timeout_s=10, what="Redis to answer a PING")


async def test_a_frozen_redis_times_out_and_the_connection_is_replaced(
        own_redis_server: RedisServer) -> None:
    client = make_client(own_redis_server.url, 0.05)  # socket timeout: the 0.25 s floor
    assert isinstance(client, Redis)
    batcher = CommandBatcher(client)
    try:
        # Connected first, with retries: a loaded machine may miss the 0.25 s once.
        await until_answers(batcher)
        assert await batcher.execute("INCR", "n") == 1
        own_redis_server.pause()
        try:
            with pytest.raises(RedisTimeoutError, match="Timeout reading"):
                await asyncio.wait_for(batcher.execute("INCR", "n"), 10)
            assert batcher.in_flight == 0  # the slot came back with the connection's failure
        finally:
            own_redis_server.resume()
        # The stalled INCR may have run once Redis woke; the new connection answers either way.
        assert await batcher.execute("INCR", "n") in (2, 3)
    finally:
        await batcher.aclose()
        await client.aclose()


async def test_aclose_waits_for_the_replies_in_flight(client: Redis) -> None:
    batcher = CommandBatcher(client)
    calls = [asyncio.ensure_future(batcher.execute("ECHO", str(i))) for i in range(10)]
    await asyncio.sleep(0)
    await batcher.aclose()
    assert [call.result() for call in calls] == [str(i).encode() for i in range(10)]
    with pytest.raises(RedisConnectionError, match="closed"):
        await batcher.execute("PING")


def test_the_same_on_uvloop(own_redis_server: RedisServer) -> None:
    """The services run on uvloop, whose transports are not asyncio's classes: replies, an
    error, a cancellation after the write, Redis killed and restarted."""

    async def scenario() -> None:
        client = make_client(own_redis_server.url, 1.0)
        assert isinstance(client, Redis)
        batcher = CommandBatcher(client)
        try:
            replies = await asyncio.gather(*(batcher.execute("ECHO", str(i)) for i in range(300)),
                                           batcher.execute("EVALSHA", "0" * 40, 0),
                                           return_exceptions=True)
            assert replies[:300] == [str(i).encode() for i in range(300)]
            assert isinstance(replies[300], NoScriptError)
            blocked = asyncio.ensure_future(batcher.execute("BLPOP", "queue", 30))
            behind = asyncio.ensure_future(batcher.execute("ECHO", "behind"))

            async def blocked_in_redis() -> bool:
                return int((await client.info("clients"))["blocked_clients"]) == 1

            await until(blocked_in_redis, timeout_s=10, what="the BLPOP to block in Redis")
            blocked.cancel()
            await client.rpush("queue", "dropped")
            assert await asyncio.wait_for(behind, 10) == b"behind"
            stuck = asyncio.ensure_future(batcher.execute("BLPOP", "queue", 30))
            await until(blocked_in_redis, timeout_s=10, what="the second BLPOP to block")
            own_redis_server.kill()
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(stuck, 10)
            own_redis_server.restart()
            assert await batcher.execute("ECHO", "back") == b"back"
        finally:
            await batcher.aclose()
            await client.aclose()

    uvloop.run(scenario())


async def test_a_decision_is_one_evalsha_and_nothing_else(client: Redis) -> None:
    """What Redis runs per decision is unchanged (INFO commandstats): one EVALSHA (after the
    first, which loads the script by EVAL), no per-command or per-connection extras."""
    store = RedisStore(client)
    hits = [Hit(key=f"rl:one:{{k{i}}}", spec=BucketSpec(capacity=1e9, rate=1e6), hits=1)
            for i in range(3)]
    await client.script_flush()
    await store.decide(hits)  # NOSCRIPT, then EVAL
    await client.config_resetstat()
    await asyncio.gather(*(store.decide(hits) for _ in range(200)))
    calls = {name: stat["calls"] for name, stat in (await client.info("commandstats")).items()}
    await store.aclose()
    ran = {name: n for name, n in calls.items()
           if name not in ("cmdstat_info", "cmdstat_config", "cmdstat_hset", "cmdstat_hmget",
                           "cmdstat_pexpire", "cmdstat_time")}  # the script's own calls
    assert ran == {"cmdstat_evalsha": 200}, calls


async def test_a_caller_that_gave_up_after_sending_can_still_have_the_reply(
        batcher: CommandBatcher, client: Redis) -> None:
    """``late`` gets the reply of a command its caller was cancelled on once it was sent (it
    still ran in Redis: the rate limiter undoes such a decision); one cancelled before it was
    sent never runs and never calls it."""
    late: list[Any] = []
    await batcher.execute("PING")
    blocked = asyncio.ensure_future(batcher.execute("BLPOP", "late-queue", 30, late=late.append))

    async def blocked_in_redis() -> bool:
        return int((await client.info("clients"))["blocked_clients"]) == 1

    await until(blocked_in_redis, timeout_s=10, what="the BLPOP to block in Redis")
    blocked.cancel()
    unsent = asyncio.ensure_future(batcher.execute("INCR", "never", late=late.append))
    unsent.cancel()  # before the iteration's write
    await client.rpush("late-queue", "ran")
    await until(lambda: bool(late), timeout_s=10, what="the late reply")
    assert late == [[b"late-queue", b"ran"]]
    assert await batcher.execute("GET", "never") is None
    assert batcher.in_flight == 0
