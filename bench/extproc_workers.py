"""extproc messages/s with ``--workers 1`` against ``--workers N``, driven directly over gRPC.

    .venv/bin/python -m bench.extproc_workers [--workers 2] [--duration 15] [--repeats 3]
        [--clients 2] [--concurrency 16]

Each stream is what Envoy sends for a non-streamed chat request: request headers, request
body, response headers, response body (with usage); the client reads the four answers and then
resets the stream, as Envoy's ext_proc filter does. The load comes from ``--clients`` separate
processes (grpc.aio, ``--concurrency`` streams each, one channel each, so the kernel's
SO_REUSEPORT spreads their connections over the workers). The rows alternate (1, N, 1, N...)
in one run, so a machine that gets busier part-way hurts both alike; the ratio is of medians.
CPU is from ``/proc`` (server: the supervisor and its workers; clients: the load processes);
the load average is printed beside it, because the load generator, other work on the machine
and extproc share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import yaml

from bench import bodies
from bench.acct import cpu_seconds
from sidecar_runtime.process.procs import free_port, sidecar_command, start, wait_http_ok

CLIENT = r"""
import asyncio, json, sys, time
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

port, duration, concurrency = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[4], "rb") as handle:
    request_body, response_body = handle.read().split(b"\0")

def headers(phase, pairs, end):
    message = pb.ProcessingRequest()
    part = getattr(message, phase)
    for key, value in pairs:
        header = part.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    part.end_of_stream = end
    return message

def body(phase, raw):
    message = pb.ProcessingRequest()
    part = getattr(message, phase)
    part.body, part.end_of_stream = raw, True
    return message

STREAM = [
    headers("request_headers", [(":method", "POST"), (":path", "/v1/chat/completions"),
                                (":authority", "bench"), ("content-type", "application/json"),
                                ("authorization", "Bearer sk-bench")], False),
    body("request_body", request_body),
    headers("response_headers", [(":status", "200"), ("content-type", "application/json")],
            False),
    body("response_body", response_body),
]

async def one(stub):
    call = stub.Process()
    answered = 0
    for message in STREAM:
        await call.write(message)
        reply = await call.read()
        answered += 1
        if reply.WhichOneof("response") == "immediate_response":
            break
    call.cancel()  # Envoy resets the stream after the last answer
    return answered

async def worker(stop_at, counts):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        await one(stub)  # connect, warm up
        counts["started"] = counts.get("started", 0) + 1
        while counts["started"] < concurrency:
            await asyncio.sleep(0.01)
        while time.perf_counter() < stop_at[0]:
            answered = await one(stub)  # not "+= await": that would lose updates
            counts["messages"] += answered
            counts["streams"] += 1

async def main():
    counts = {"messages": 0, "streams": 0}
    stop_at = [time.perf_counter() + 3600]
    tasks = [asyncio.create_task(worker(stop_at, counts)) for _ in range(concurrency)]
    while counts.get("started", 0) < concurrency:
        await asyncio.sleep(0.01)
    sys.stdout.write("ready\n"); sys.stdout.flush()
    sys.stdin.readline()  # the go signal: every client starts together
    began, cpu = time.perf_counter(), time.process_time()
    counts["messages"] = counts["streams"] = 0
    stop_at[0] = began + duration
    await asyncio.gather(*tasks)
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    print(json.dumps({"messages": counts["messages"], "streams": counts["streams"],
                      "seconds": elapsed, "cpu": cpu}), flush=True)

asyncio.run(main())
"""


def routing_doc(port: int) -> dict[str, Any]:
    return {
        "version": 1,
        "services": {"extproc": f"127.0.0.1:{port}", "ratelimit": "127.0.0.1:1"},
        "clusters": {"pool": {"endpoints": ["127.0.0.1:9"], "max_context": 4096}},
        "models": {bodies.MODEL: {"clusters": ["pool"], "default_max_tokens": 64}},
        # Every response read: each stream takes the four messages this bench sends.
        "telemetry": {"sample": 1},
    }


def load_average() -> str:
    return " ".join(open("/proc/loadavg", encoding="ascii").read().split()[:3])


def measure(config: str, workers: int, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    import subprocess

    port, metrics = free_port(), free_port()
    server = start(f"extproc x{workers}", sidecar_command(
        "extproc", "--config", config, "--port", str(port), "--metrics-port", str(metrics),
        "--workers", str(workers)),
        env={**os.environ, "LLM_SIDECAR_LOG_LEVEL": "error", "LLM_SIDECAR_DEV_MODE": "true"},
        log_path=os.path.join(workdir, "extproc.log"))
    clients: list[subprocess.Popen[bytes]] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{metrics}/healthz", 120, server)
        payload = os.path.join(workdir, "bodies")
        bodies.write_extproc_load(payload)
        command = ([sys.executable, "-m", "bench.h2_extproc_load", str(port),
                    str(args.duration), str(args.connections), str(args.concurrency), payload]
                   if args.client == "raw" else
                   [sys.executable, "-c", CLIENT, str(port), str(args.duration),
                    str(args.concurrency), payload])
        for _ in range(args.clients):
            clients.append(subprocess.Popen(command, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE))
        for client in clients:
            assert client.stdout is not None
            if client.stdout.readline().strip() != b"ready":
                raise RuntimeError("a load client did not start")
        load_before = load_average()
        server_cpu = cpu_seconds(server.process.pid)
        for client in clients:
            assert client.stdin is not None
            client.stdin.write(b"go\n")
            client.stdin.flush()
        results = [json.loads(c.communicate()[0]) for c in clients]
        server_cpu = cpu_seconds(server.process.pid) - server_cpu
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        code = server.stop(60)
    messages = sum(r["messages"] for r in results)
    seconds = max(r["seconds"] for r in results)
    return {"workers": workers, "messages_per_s": messages / seconds,
            "streams": sum(r["streams"] for r in results),
            "messages_per_stream": messages / max(1, sum(r["streams"] for r in results)),
            "server_cpu_cores": server_cpu / seconds,
            "server_cpu_us_per_message": server_cpu / messages * 1e6,
            "client_cpu_cores": sum(r["cpu"] for r in results) / seconds,
            "load_before": load_before, "load_after": load_average(), "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client", choices=("raw", "grpc"), default="raw",
                        help="raw: prebuilt HTTP/2 frames (bench/h2_extproc_load.py), a few "
                             "percent of extproc's CPU; grpc: grpc.aio, about as costly as "
                             "extproc itself")
    parser.add_argument("--clients", type=int, default=1, help="load processes")
    # SO_REUSEPORT hands each connection to a worker by a hash of its addresses: with 4
    # connections all of them landed on one of two workers in 1 run of 8 (1.01x), 3 to 1 in
    # others; 16 spread evenly enough for the ratio to measure the workers, not the hash.
    parser.add_argument("--connections", type=int, default=16,
                        help="connections per load process (raw client)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="streams in flight per connection (raw) or per process (grpc)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        config = os.path.join(workdir, "routing.yaml")
        with open(config, "w", encoding="utf-8") as handle:
            yaml.safe_dump(routing_doc(1), handle)
        for _ in range(args.repeats):
            for workers in (1, args.workers):
                row = measure(config, workers, args, workdir)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    one = statistics.median(r["messages_per_s"] for r in rows if r["workers"] == 1)
    many = statistics.median(r["messages_per_s"] for r in rows if r["workers"] == args.workers)
    print("| workers | messages/s | extproc cores | extproc µs/message | load client cores | "
          "load avg before → after |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['workers']} | {row['messages_per_s']:.0f} | "
              f"{row['server_cpu_cores']:.2f} | {row['server_cpu_us_per_message']:.0f} | "
              f"{row['client_cpu_cores']:.2f} | "
              f"{row['load_before']} → {row['load_after']} |")
    print(f"\nmedian messages/s: 1 worker {one:.0f}, {args.workers} workers {many:.0f}: "
          f"{many / one:.2f}x (cores: {os.cpu_count()})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "ratio": many / one}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
