"""The ``llm-sidecar sim`` command: its flags and its entry point."""

from __future__ import annotations

import argparse
import asyncio

from sidecar_runtime.process.logs import configure, get_logger
from simulator.config import SimConfig
from simulator.exposition import ENGINES
from simulator.prefix import DEFAULT_BLOCK_SIZE
from simulator.server import serve_until_signalled


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    parser.add_argument("--name", required=True, help="pool name, sent back as x-sim-name")
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="context window in tokens (default 2048)"
    )
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated served model names (default: accept any model name)",
    )
    parser.add_argument(
        "--prefill-ms-per-token", type=float, default=0.0, help="prefill delay per prompt token"
    )
    parser.add_argument("--decode-ms-per-token", type=float, default=2.0, help="delay per generated token")
    parser.add_argument(
        "--default-output-tokens",
        type=int,
        default=16,
        help="tokens generated when a request sets no max_tokens (default 16)",
    )
    parser.add_argument(
        "--natural-stop",
        action="store_true",
        help="answers end at --default-output-tokens (finish stop) even when max_tokens allows "
        "more, as a real model's end-of-sequence token ends them (default: max_tokens is always "
        "reached)",
    )
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="share of each answer's words replaced by others, 0 to 1 (a canary that answers "
        "differently; default 0: the same prompt gets the same answer on every pod)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk, as vLLM's --stream-interval (default 1)",
    )
    parser.add_argument("--embedding-dim", type=int, default=256, help="embedding vector size (default 256)")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json to count tokens with (default: estimate)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences generated at once (default 256)"
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="simulated KV-cache size in tokens; requests wait while running prompts and output "
        "budgets fill it (default 8 x max-model-len)",
    )
    parser.add_argument(
        "--prefix-block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"prefix-cache block in tokens (default {DEFAULT_BLOCK_SIZE}, as vLLM's --block-size)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="GPU speed factor: prefill and decode times are divided by it (default 1.0)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="whose metric names and text /metrics serves, and the JSON shape of its stream "
        "chunks (default vllm)",
    )
    parser.add_argument(
        "--no-dcgm",
        dest="dcgm",
        action="store_false",
        help="do not serve the DCGM-style GPU gauges at /dcgm/metrics",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` the parsed flags describe; ``ValueError`` when they are invalid."""
    models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
    return SimConfig(
        name=args.name,
        max_model_len=args.max_model_len,
        models=models,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        default_output_tokens=args.default_output_tokens,
        natural_stop=args.natural_stop,
        drift=args.drift,
        stream_interval=args.stream_interval,
        embedding_dim=args.embedding_dim,
        tokenizer=args.tokenizer,
        max_num_seqs=args.max_num_seqs,
        kv_cache_tokens=args.kv_cache_tokens,
        prefix_block_size=args.prefix_block_size,
        speed=args.speed,
        dcgm=args.dcgm,
        engine=args.engine,
    )


def run(args: argparse.Namespace, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM, logging at ``log_level`` (``LLM_SIDECAR_LOG_LEVEL`` under
    ``llm-sidecar sim``); 0 after a clean stop, 2 for invalid settings, 1 if the address cannot
    be bound."""
    configure(log_level, "simulator")
    # Fetched after configure(): structlog caches a logger on first use, stream included.
    log = get_logger("simulator")
    try:
        config = config_from_args(args)
        asyncio.run(serve_until_signalled(config, args.host, args.port))
    except ValueError as exc:
        log.error("simulator_invalid_settings", error=str(exc))
        return 2
    except OSError as exc:
        log.error("simulator_cannot_listen", host=args.host, port=args.port, error=str(exc))
        return 1
    return 0
