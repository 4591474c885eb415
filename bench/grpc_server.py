"""CPU per ext_proc message of grpc.aio's server against ours (sidecar_runtime.h2grpc), alone.

    .venv/bin/python -m bench.grpc_server [--seconds 5] [--repeats 2] [--baseline REF]

Each server runs in its own process with the same servicer: it answers every ProcessingRequest
with an empty answer of the same phase, so what is measured is the server's machinery, not
extproc's work. The load is ``bench.h2_extproc_load`` (raw HTTP/2, 4 connections x 16 streams
of the four messages of a chat request), the rows alternate (aio, ours, aio, ours...), and CPU
is the server process's (all its threads) from ``/proc``.

``--baseline REF`` adds a row ``h2grpc@REF``: the same server from ``sidecar_runtime`` as it is
at git revision REF (``git archive`` into a temporary directory, removed afterwards; the server
process runs there with it first on ``PYTHONPATH``, and reports the ``sidecar_runtime`` it
imported, which is checked). The rows then alternate grpc.aio, h2grpc@REF, h2grpc (this working
tree, uncommitted edits included), and after the table come the ratios of h2grpc's CPU per
message to h2grpc@REF's, per repeat and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import bodies
from bench.acct import cpu_seconds
from sidecar_runtime.process.procs import free_port

SERVER = r"""
import asyncio, sys
import grpc, uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
import sidecar_runtime
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
    print("listening", sidecar_runtime.__file__, flush=True)
    await asyncio.Event().wait()

uvloop.run(main(sys.argv[1], int(sys.argv[2])))
"""

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Kind:
    """One row kind: its label, the server to start, and the tree its ``sidecar_runtime`` is from.

    ``root`` is the server process's working directory, which ``python -c`` puts first on
    ``sys.path`` (ahead of ``PYTHONPATH`` and of the editable install's finder).
    """

    label: str
    server: str
    root: Path


def baseline_tree(ref: str, into: Path) -> None:
    """Extract ``sidecar_runtime`` as it is at git revision ``ref`` into ``into``."""
    archive = subprocess.run(["git", "archive", ref, "--", "sidecar_runtime"], cwd=REPO,
                             check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def one(kind: Kind, seconds: float, bodies_path: str) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(kind.root), *filter(None, [os.environ.get("PYTHONPATH")])])
    server = subprocess.Popen([sys.executable, "-c", SERVER, kind.server, str(port)],
                              stdout=subprocess.PIPE, cwd=kind.root, env=env)
    try:
        assert server.stdout is not None
        banner = server.stdout.readline().decode().split()
        if banner[:1] != ["listening"]:
            raise RuntimeError(f"the {kind.label} server did not start")
        imported = Path(banner[1]).resolve()
        if imported != kind.root.resolve() / "sidecar_runtime" / "__init__.py":
            raise RuntimeError(f"the {kind.label} server imported {imported}, not {kind.root}'s")
        client = subprocess.Popen(
            [sys.executable, "-m", "bench.h2_extproc_load", str(port), str(seconds), "4", "16",
             bodies_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
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
    parser.add_argument("--baseline", metavar="REF",
                        help="also run h2grpc as it is at this git revision (row h2grpc@REF)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        kinds = [Kind("grpc.aio", "grpc.aio", REPO)]
        if args.baseline is not None:
            tree = Path(workdir) / "baseline"
            tree.mkdir()
            baseline_tree(args.baseline, tree)
            kinds.append(Kind(f"h2grpc@{args.baseline}", "h2grpc", tree))
        kinds.append(Kind("h2grpc", "h2grpc", REPO))
        path = os.path.join(workdir, "bodies")
        bodies.write_extproc_load(path)
        print("| server | messages/s | server cores | µs CPU per message | load client cores |")
        print("|---|---|---|---|---|")
        ratios: list[float] = []
        for _ in range(args.repeats):
            per_message: dict[str, float] = {}
            for kind in kinds:
                row = one(kind, args.seconds, path)
                per_message[kind.label] = row["us/message"]
                print(f"| {kind.label} | {row['messages/s']:,.0f} | {row['cores']:.2f} | "
                      f"{row['us/message']:.1f} | {row['client cores']:.2f} |", flush=True)
            if args.baseline is not None:
                ratios.append(per_message["h2grpc"] / per_message[kinds[1].label])
    if ratios:
        print(f"\nh2grpc / h2grpc@{args.baseline}, µs CPU per message: "
              + " / ".join(f"{ratio:.3f}" for ratio in ratios)
              + f" (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
