"""The h2grpc server in a process of its own, for the attacks of ``test_attacks.py``: its memory
(RSS) is then the server's alone, and its event loop is not the attacker's.

    python -m tests.sidecar_runtime.h2grpc.attack_server MAX_RECEIVE LIMITS_JSON

serves the test methods and grpc.health.v1 on 127.0.0.1 with ``Limits(**LIMITS_JSON)`` (rates as
``[burst, per_s]``) and prints ``port N`` once it listens. It stops when its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from sidecar_runtime.h2grpc.limits import Limits, Rate
from tests.sidecar_runtime.h2grpc.servicers import running_server


def limits_from(raw: dict[str, Any]) -> Limits:
    fields: dict[str, Any] = {key: Rate(*value) if isinstance(value, list) else value
                              for key, value in raw.items()}
    return Limits(**fields)


async def serve(max_receive: int, limits: Limits) -> None:
    async with running_server(max_receive=max_receive, limits=limits) as running:
        print(f"port {running.port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def main() -> None:
    asyncio.run(serve(int(sys.argv[1]), limits_from(json.loads(sys.argv[2]))))


if __name__ == "__main__":
    main()
