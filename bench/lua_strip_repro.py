"""Reproduce (or rule out) streams cut short by the Lua filter that strips the usage chunk.

Real Envoy, no extproc: the filters ``routing.render.usage`` renders (Lua strip, then
``sse_to_metadata``), in front of a paced SSE upstream written here (one ``data:`` event per
token as vLLM writes them, a usage chunk, ``data: [DONE]``), with N concurrent aiohttp clients
on HTTP/1.1 keep-alive connections (as the soak drives the gateway). A ``header_to_metadata``
filter sets ``llm_sidecar.strip_usage`` from a request header (extproc's job in the gateway).

extproc's place in the chain is taken by a *holder*: a second Lua filter whose
``envoy_on_response`` makes an ``httpCall`` to the upstream's ``/hold`` (which answers after a
random 0..``--hold-ms`` ms). Like ext_proc waiting for extproc's answer to the response
headers, it holds the response headers while the upstream's body chunks reach the filters after
it in the chain (before it, on the response path).

    .venv/bin/python -m bench.lua_strip_repro --order before-fix --tokens 4
    .venv/bin/python -m bench.lua_strip_repro --order rendered --tokens 4
    .venv/bin/python -m bench.lua_strip_repro --raw       # one cut stream's bytes, as received
    .venv/bin/python -m bench.lua_strip_repro --cpu-against b40486c --tokens 64 --requests 1500 \
        --concurrency 16      # Envoy's CPU per stream: this strip against b40486c's

Each run prints the outcomes (``ok``; ``cut``: no ``[DONE]``; ``usage``: the usage chunk reached
a client that did not ask for it; exception names) and what the responses were framed with.
Findings: docs/decisions/0006-lua-usage-strip.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import yaml

from bench.acct import cpu_seconds
from routing.loader import load_config
from routing.render.clusters import API, TYPE
from routing.render.envoy import http_connection_manager
from routing.render.usage import LUA_FILTER, SSE_FILTER, sse_usage_filter, strip_usage_filter
from sidecar_runtime.process.procs import envoy_binary, start, wait_http_ok
from sidecar_runtime.wire.names import METADATA_NAMESPACE, STRIP_USAGE_METADATA_KEY

MAIN_LUA = f"""
function envoy_on_response(handle)
  local md = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if md == nil or md["{STRIP_USAGE_METADATA_KEY}"] ~= "1" then return end
  local carry = ""
  for chunk in handle:bodyChunks() do
    local data = carry .. chunk:getBytes(0, chunk:length())
    local last, from = nil, 1
    while true do
      local _, e = string.find(data, "\\n\\n", from, true)
      if e == nil then break end
      last, from = e, e + 1
    end
    local out = ""
    if last == nil then
      carry = data
    else
      out, carry = string.sub(data, 1, last), string.sub(data, last + 1)
      out = string.gsub(out, 'data: {{[^\\n]-"choices":%[%],"usage":{{[^\\n]*\\n\\n', "")
    end
    chunk:setBytes(out)
  end
end
"""
"""The Lua before the fix (main at 77283c3): ``setBytes`` on every chunk."""

COMMENT_LUA = f"""
function envoy_on_response(handle)
  local md = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if md == nil or md["{STRIP_USAGE_METADATA_KEY}"] ~= "1" then return end
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local out, count = string.gsub(chunk:getBytes(0, n),
                                     'data: {{[^\\n]-"choices":%[%],"usage":{{[^\\n]*\\n\\n', ":\\n\\n")
      if count > 0 then chunk:setBytes(out) end
    end
  end
end
"""
"""The first attempted fix (branch lua-fix, 09640dc): the usage event becomes an SSE comment,
``setBytes`` only on the chunk that held it, no chunk emptied."""

HOLD_LUA = """
function envoy_on_response(handle)
  handle:httpCall("upstream", {[":method"] = "GET", [":path"] = "/hold",
                               [":authority"] = "upstream"}, "", 10000)
end
"""

ORDERS = {
    # The gateway's chain before the fix: ext_proc, then the Lua strip, then sse_to_metadata.
    "before-fix": ("meta", "hold", "lua", "sse"),
    # The Lua strip before ext_proc in the chain: after it on the response path.
    "lua-first": ("meta", "lua", "hold", "sse"),
    "no-lua": ("meta", "hold", "sse"),
    "no-sse": ("meta", "hold", "lua"),
    "no-hold": ("meta", "lua", "sse"),
}


def rendered_order() -> tuple[str, ...]:
    """ext_proc (as the holder) and the usage filters in the order ``render`` writes them."""
    doc = {"version": 1, "clusters": {"p": {"endpoints": ["127.0.0.1:9"], "max_context": 2048}},
           "models": {"m": {"clusters": ["p"]}},
           "rate_limits": {"tenant": {"default": {"tokens": "1M/min"}}},
           "telemetry": {"envoy_usage": True}}
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "routing.yaml")
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(doc, handle)
        filters = http_connection_manager(load_config(path))["http_filters"]
    kinds = {"envoy.filters.http.ext_proc": "hold", LUA_FILTER: "lua", SSE_FILTER: "sse"}
    return ("meta", *(kinds[f["name"]] for f in filters if f["name"] in kinds))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lua_at(ref: str) -> str:
    """The strip's Lua as ``routing/render/usage.py`` renders it at git ``ref``."""
    source = subprocess.run(["git", "show", f"{ref}:routing/render/usage.py"], check=True,
                            capture_output=True, text=True).stdout
    module: dict[str, Any] = {"__name__": "render_usage_at_ref"}
    exec(compile(source, f"{ref}:routing/render/usage.py", "exec"), module)
    return str(module["STRIP_USAGE_LUA"])


def _filter(kind: str, lua: str) -> dict[str, Any]:
    if kind == "lua":
        rendered = strip_usage_filter()
        if lua != "rendered":
            source = {"main": MAIN_LUA, "comment": COMMENT_LUA}.get(lua) or lua_at(lua)
            rendered["typed_config"]["default_source_code"]["inline_string"] = source
        return rendered
    if kind == "sse":
        return sse_usage_filter()
    if kind == "hold":
        return {"name": "hold", "typed_config": {
            TYPE: API + "extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": HOLD_LUA}}}
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        TYPE: API + "extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": "x-strip-usage", "on_header_present": {
            "metadata_namespace": METADATA_NAMESPACE, "key": STRIP_USAGE_METADATA_KEY,
            "type": "STRING"}, "remove": True}]}}


def bootstrap(order: str, lua: str, listen: int, admin: int, upstream: int) -> dict[str, Any]:
    kinds = rendered_order() if order == "rendered" else ORDERS[order]
    filters = [_filter(kind, lua) for kind in kinds]
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        TYPE: API + "extensions.filters.http.router.v3.Router"}})
    hcm = {
        TYPE: API + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "repro", "codec_type": "AUTO",
        "access_log": [{"name": "envoy.access_loggers.stdout", "typed_config": {
            TYPE: API + "extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string":
                "ACCESS %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_SENT% "
                "cl=%RESP(CONTENT-LENGTH)% %DYNAMIC_METADATA(llm_sidecar)%\n"}}}}],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "0s"}}]}]},
        "http_filters": filters,
    }
    address = {"socket_address": {"address": "127.0.0.1", "port_value": upstream}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": {
                "address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}]}],
            "clusters": [{"name": "upstream", "type": "STATIC", "connect_timeout": "2s",
                          "load_assignment": {"cluster_name": "upstream", "endpoints": [
                              {"lb_endpoints": [{"endpoint": {"address": address}}]}]}}],
        },
    }


def events(tokens: int) -> list[bytes]:
    """What vLLM streams for ``include_usage``: one event per token, the usage chunk, [DONE]."""
    out = []
    for i in range(tokens):
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        out.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    usage = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                       "total_tokens": tokens + 5}}
    out.append(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def writes(tokens: int, pattern: str) -> list[bytes]:
    """The upstream's writes (each one HTTP chunk): per event, events split mid-line, or all
    the events in one write."""
    evs = events(tokens)
    if pattern == "one":
        return [b"".join(evs)]
    if pattern == "split":
        return [part for ev in evs for part in (ev[:len(ev) // 2], ev[len(ev) // 2:])]
    return evs


class Upstream:
    """The paced SSE pool; ``GET /hold`` answers after ``hold_from_ms`` + 0..``hold_ms`` ms."""

    def __init__(self, tokens: int, pace_ms: float, pattern: str, hold_ms: float,
                 hold_from_ms: float = 0.0,
                 streams: dict[str, list[bytes]] | None = None) -> None:
        self.tokens, self.pace_ms, self.pattern = tokens, pace_ms, pattern
        self.hold_ms, self.hold_from_ms = hold_ms, hold_from_ms
        self.streams = streams or {}
        """HTTP chunks to answer a request for a path with, as given (another engine's
        bytes), instead of vLLM's."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if lines[0].startswith("GET /hold"):
                    await asyncio.sleep((self.hold_from_ms + random.uniform(0, self.hold_ms)) / 1000)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                path = lines[0].split(" ")[1] if " " in lines[0] else ""
                for data in self.streams.get(path) or writes(self.tokens, self.pattern):
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await writer.drain()
                    if self.pace_ms:
                        await asyncio.sleep(self.pace_ms / 1000)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def drive(url: str, requests: int, concurrency: int) -> tuple[Counter[str], Counter[str]]:
    outcomes: Counter[str] = Counter()
    framing: Counter[str] = Counter()
    todo = iter(range(requests))
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def user() -> None:
            for _ in todo:
                try:
                    async with session.post(url, data=body, headers={
                            "content-type": "application/json", "x-strip-usage": "1"}) as resp:
                        got = await resp.read()
                        framing["content-length" if "content-length" in resp.headers
                                else resp.headers.get("transfer-encoding", "none")] += 1
                        if not got.endswith(b"data: [DONE]\n\n"):
                            outcomes["cut"] += 1
                        elif b'"usage"' in got:
                            outcomes["usage"] += 1
                        else:
                            outcomes["ok"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcomes[type(exc).__name__] += 1
        await asyncio.gather(*(user() for _ in range(concurrency)))
    return outcomes, framing


def raw_exchange(port: int, requests: int) -> bytes:
    """``requests`` streamed requests on one keep-alive connection; every byte received."""
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
               b"application/json\r\nx-strip-usage: 1\r\ncontent-length: %d\r\n\r\n%s"
               % (len(body), body))
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        for _ in range(requests):
            sock.sendall(request)
            time.sleep(0.3)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    return received


@contextmanager
def repro_envoy(order: str, lua: str, upstream: Upstream, log_level: str = "warning",
                pids: list[int] | None = None) -> Iterator[tuple[int, int, str]]:
    """The upstream (on its own thread) and Envoy; yields Envoy's listener and admin ports and
    its log file (and adds Envoy's pid to ``pids``)."""
    loop = asyncio.new_event_loop()
    up_port, listen, admin = _free_port(), _free_port(), _free_port()
    server = loop.run_until_complete(asyncio.start_server(upstream.serve, "127.0.0.1", up_port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    workdir = tempfile.mkdtemp(prefix="lua-repro-")
    path = os.path.join(workdir, "envoy.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(bootstrap(order, lua, listen, admin, up_port), handle)
    log = os.path.join(workdir, "envoy.log")
    child = start("envoy", [envoy_binary(), "-c", path, "--log-level", log_level,
                            "--disable-hot-restart", "--concurrency", "2"], log_path=log)
    if pids is not None:
        pids.append(child.process.pid)
    try:
        wait_http_ok(f"http://127.0.0.1:{admin}/ready", 30, child)
        yield listen, admin, log
    finally:
        child.stop()
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def cpu_against(args: argparse.Namespace) -> int:
    """Envoy's CPU per stream with the rendered strip and with ``args.cpu_against``'s, rounds
    alternating, each on a fresh Envoy warmed by 50 streams."""
    url_path = "/v1/chat/completions"
    per_stream: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for lua in ("rendered", args.cpu_against):
            pids: list[int] = []
            upstream = Upstream(args.tokens, 0.0, args.pattern, 0.0)
            with repro_envoy("rendered", lua, upstream, args.log_level, pids) as (listen, _a, _l):
                asyncio.run(drive(f"http://127.0.0.1:{listen}{url_path}", 50, 8))
                before = cpu_seconds(pids[0])
                outcomes, _ = asyncio.run(drive(f"http://127.0.0.1:{listen}{url_path}",
                                                args.requests, args.concurrency))
                used = cpu_seconds(pids[0]) - before
            per_stream.setdefault(lua, []).append(used / args.requests * 1e6)
            print(f"lua={lua}: {used / args.requests * 1e6:.0f} µs Envoy CPU per "
                  f"{args.tokens}-token stream {dict(outcomes)}", flush=True)
    medians = {lua: sorted(v)[len(v) // 2] for lua, v in per_stream.items()}
    print(f"median: rendered {medians['rendered']:.0f} µs, {args.cpu_against} "
          f"{medians[args.cpu_against]:.0f} µs, ratio "
          f"{medians['rendered'] / medians[args.cpu_against]:.3f}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.cpu_against:
        return cpu_against(args)
    upstream = Upstream(args.tokens, args.pace_ms, args.pattern, args.hold_ms)
    with repro_envoy(args.order, args.lua, upstream, args.log_level) as (listen, admin, log):
        if args.raw:
            print(raw_exchange(listen, 2).decode(errors="replace"))
            return 0
        outcomes, framing = asyncio.run(drive(
            f"http://127.0.0.1:{listen}/v1/chat/completions", args.requests, args.concurrency))
        print(f"order={args.order} lua={args.lua} pattern={args.pattern} tokens={args.tokens} "
              f"pace={args.pace_ms}ms hold<= {args.hold_ms}ms: {dict(outcomes)} "
              f"framing {dict(framing)}")
        print("  " + " ".join(f"{k}={v}" for k, v in _stats(admin).items()))
        print(f"  envoy log: {log}")
        return 0 if set(outcomes) == {"ok"} else 1


def _stats(admin: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats", timeout=5) as resp:
        text = resp.read().decode()
    wanted = ("http.repro.downstream_rq_2xx", "http.repro.downstream_rq_rx_reset",
              "http.repro.downstream_rq_tx_reset", "http.repro.downstream_cx_protocol_error",
              "http.repro.lua.errors", "http.repro.downstream_rq_completed")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name in wanted or name.endswith(".lua.errors"):
            out[name.removeprefix("http.repro.")] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lua_strip_repro", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--order", choices=["rendered", *sorted(ORDERS)], default="rendered",
                        help="rendered: as render writes the chain (ext_proc as the holder)")
    parser.add_argument("--lua", default="rendered",
                        help="rendered: the Lua routing.render.usage renders; main: main's "
                             "before the fix; comment: 09640dc's; else a git ref whose "
                             "routing/render/usage.py renders it")
    parser.add_argument("--cpu-against", metavar="REF",
                        help="measure Envoy's CPU per stream with the rendered strip and with "
                             "REF's, alternating (--rounds), instead of looking for cut streams")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pattern", choices=("event", "split", "one"), default="event")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--pace-ms", type=float, default=1.0)
    parser.add_argument("--hold-ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--raw", action="store_true")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
