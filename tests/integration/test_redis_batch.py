"""Commands of one loop iteration go to Redis as one pipeline, each caller getting its own reply
(or its own error), against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from sidecar_runtime import redis_batch
from sidecar_runtime.procs import free_port
from sidecar_runtime.redis_batch import CommandBatcher
from sidecar_runtime.redis_client import make_client
from tests.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis


class Counting:
    """Counts the pipelines the batcher runs (and the commands in each)."""

    def __init__(self, client: Redis) -> None:
        self.sizes: list[int] = []
        original = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = original(*args, **kwargs)
            execute = pipe.execute

            async def counted(*a: Any, **k: Any) -> Any:
                self.sizes.append(len(pipe.command_stack))
                return await execute(*a, **k)

            pipe.execute = counted  # type: ignore[method-assign]
            return pipe

        client.pipeline = pipeline  # type: ignore[method-assign]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    made = make_client(redis_server.url, 1.0)
    assert isinstance(made, Redis)
    await made.flushdb()
    yield made
    await made.aclose()


async def test_commands_of_one_iteration_go_as_one_pipeline_each_with_its_reply(
        client: Redis) -> None:
    counting = Counting(client)
    batcher = CommandBatcher(client)
    replies = await asyncio.gather(*(batcher.execute("INCRBY", "n", i) for i in range(1, 51)))
    assert counting.sizes == [50]
    # Each caller got the reply to its own command, in the order Redis ran them.
    assert sorted(replies) == replies and replies[-1] == sum(range(1, 51))
    assert await client.get("n") == str(sum(range(1, 51))).encode()


async def test_a_lone_command_is_sent_at_once_and_a_burst_above_the_cap_is_split(
        client: Redis) -> None:
    counting = Counting(client)
    batcher = CommandBatcher(client)
    assert await batcher.execute("SET", "k", "v") is True
    assert counting.sizes == []  # alone in its iteration: a plain command, no pipeline
    total = redis_batch.MAX_BATCH * 2 + 5
    await asyncio.gather(*(batcher.execute("INCR", "burst") for _ in range(total)))
    assert sum(counting.sizes) == total and max(counting.sizes) <= redis_batch.MAX_BATCH
    assert await client.get("burst") == str(total).encode()


async def test_a_reply_error_fails_only_its_own_command(client: Redis) -> None:
    batcher = CommandBatcher(client)
    results = await asyncio.gather(
        batcher.execute("SET", "a", "1"),
        batcher.execute("EVALSHA", "0" * 40, 0),  # no such script
        batcher.execute("INCR", "a"),
        return_exceptions=True)
    assert results[0] is True
    assert isinstance(results[1], NoScriptError)
    assert results[2] == 2


@pytest.mark.parametrize("leaver", [0, 2])
async def test_a_caller_that_gives_up_leaves_the_others_their_replies(
        client: Redis, leaver: int) -> None:
    # 0: the first caller of the iteration, which leads the batch; 2: one that joined it.
    batcher = CommandBatcher(client)
    calls = [asyncio.ensure_future(batcher.execute("INCR", "c")) for _ in range(4)]
    await asyncio.sleep(0)  # every call is waiting in the batch
    calls[leaver].cancel()
    others = [call for n, call in enumerate(calls) if n != leaver]
    results = await asyncio.wait_for(asyncio.gather(*others), 5)
    assert sorted(results) == [1, 2, 3]  # the cancelled one was dropped before it was sent
    assert calls[leaver].cancelled()


async def test_a_dead_server_fails_every_command_of_the_batch() -> None:
    dead = make_client(f"redis://127.0.0.1:{free_port()}/0", 0.5)
    assert isinstance(dead, Redis)
    batcher = CommandBatcher(dead)
    try:
        results = await asyncio.gather(*(batcher.execute("PING") for _ in range(4)),
                                       return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        # And the batcher still works for the next ones (they fail the same way, no hang).
        with pytest.raises(RedisConnectionError):
            await batcher.execute("PING")
    finally:
        await batcher.aclose()
        await dead.aclose()
