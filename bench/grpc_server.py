"""CPU per ext_proc message of grpc.aio's server against ours (sidecar_runtime.h2grpc), alone.

    .venv/bin/python -m bench.grpc_server [--seconds 5] [--repeats 2]

Each server runs in its own process with the same servicer: it answers every ProcessingRequest
with an empty answer of the same phase, so what is measured is the server's machinery, not
extproc's work. The load is ``bench.h2_extproc_load`` (raw HTTP/2, 4 connections x 16 streams
of the four messages of a chat request), the rows alternate (aio, ours, aio, ours...), and CPU
is the server process's (all its threads) from ``/proc``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench import bodies
from bench.acct import cpu_seconds
from sidecar_runtime.procs import free_port

SERVER = r"""
import asyncio, sys
import grpc, uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from sidecar_runtime.h2grpc import Server


class Echo(pb_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        async for request in requests:
            answer = pb.ProcessingResponse()
            getattr(answer, request.WhichOneof("request")).SetInParent()
            yield answer


async def main(kind, port):
    if kind == "grpc.aio":
        server = grpc.aio.server()
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        server = Server()
        await server.add_port(f"127.0.0.1:{port}")
    pb_grpc.add_ExternalProcessorServicer_to_server(Echo(), server)
    await server.start()
    print("listening", flush=True)
    await asyncio.Event().wait()

uvloop.run(main(sys.argv[1], int(sys.argv[2])))
"""

KINDS = ("grpc.aio", "h2grpc")


def one(kind: str, seconds: float, bodies_path: str) -> dict[str, float]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, kind, str(port)],
                              stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        client = subprocess.Popen(
            [sys.executable, "-m", "bench.h2_extproc_load", str(port), str(seconds), "4", "16",
             bodies_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert client.stdin is not None and client.stdout is not None
        if client.stdout.readline().strip() != b"ready":
            raise RuntimeError("the load client did not start")
        before = cpu_seconds(server.pid)
        client.stdin.write(b"go\n")
        client.stdin.flush()
        result = json.loads(client.stdout.readline())
        used = cpu_seconds(server.pid) - before
        client.wait(timeout=30)
    finally:
        server.kill()
        server.wait()
    return {"messages/s": result["messages"] / result["seconds"],
            "cores": used / result["seconds"],
            "us/message": used / result["messages"] * 1e6,
            "client cores": result["cpu"] / result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| server | messages/s | server cores | µs CPU per message | load client cores |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "bodies")
        bodies.write_extproc_load(path)
        for _ in range(args.repeats):
            for kind in KINDS:
                row = one(kind, args.seconds, path)
                print(f"| {kind} | {row['messages/s']:,.0f} | {row['cores']:.2f} | "
                      f"{row['us/message']:.1f} | {row['client cores']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
