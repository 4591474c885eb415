"""What one simulated vLLM server is: its name, limits, served models and pacing."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.exposition import ENGINES
from simulator.prefix import DEFAULT_BLOCK_SIZE

# How many full-length sequences the simulated KV cache holds when no size is given: enough that a
# handful of long requests move `vllm:kv_cache_usage_perc` visibly, as on a small real GPU.
_DEFAULT_KV_SEQUENCES = 8


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulator; invalid values raise ``ValueError`` at construction.

    ``models`` empty means "serve any model name" (the request's ``model`` is echoed back).
    ``kv_cache_tokens`` ``None`` means ``8 * max_model_len``; a request waits until every running
    sequence's prompt and output budget plus its own fit in it. ``prefix_block_size`` is the
    block of the prefix cache in tokens. ``speed`` divides prefill and decode times (2.0: a GPU
    twice as fast). ``engine``: whose metric names and text ``/metrics`` serves, and the JSON
    shape of its stream chunks (:data:`~simulator.exposition.ENGINES`,
    :func:`simulator.sse.engine_event`). ``dcgm`` serves DCGM-exporter-style GPU gauges at
    ``/dcgm/metrics``.
    ``natural_stop``: answers end at ``default_output_tokens`` even when ``max_tokens`` allows
    more (``simulator.generation``). ``stream_interval``: tokens per streamed chunk, as vLLM's
    ``--stream-interval`` (speculative decoding also sends several tokens in one chunk).
    """

    name: str
    max_model_len: int = 2048
    models: tuple[str, ...] = ()
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 2.0
    default_output_tokens: int = 16
    natural_stop: bool = False
    stream_interval: int = 1
    embedding_dim: int = 256
    tokenizer: str | None = None
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = None
    prefix_block_size: int = DEFAULT_BLOCK_SIZE
    speed: float = 1.0
    dcgm: bool = True
    engine: str = "vllm"
    drift: float = 0.0
    """Share of each answer's words replaced by others (a canary that answers differently);
    which words, and by what, follow from the prompt, so a drifting pod is deterministic too."""

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name must not be empty")
        if self.max_model_len < 1:
            problems.append("max_model_len must be at least 1")
        if self.stream_interval < 1:
            problems.append("stream_interval must be at least 1")
        if any(not m for m in self.models):
            problems.append("model names must not be empty")
        if self.prefill_ms_per_token < 0 or self.decode_ms_per_token < 0:
            problems.append("latencies must not be negative")
        if self.default_output_tokens < 1:
            problems.append("default_output_tokens must be at least 1")
        if self.embedding_dim < 1:
            problems.append("embedding_dim must be at least 1")
        if self.max_num_seqs < 1:
            problems.append("max_num_seqs must be at least 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            problems.append("kv_cache_tokens must be at least 1")
        if self.prefix_block_size < 1:
            problems.append("prefix_block_size must be at least 1")
        if not self.speed > 0 or self.speed == float("inf"):
            problems.append("speed must be a positive number")
        if not 0.0 <= self.drift <= 1.0:
            problems.append("drift must be between 0 and 1")
        if self.engine not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def served_name(self) -> str:
        """The name metrics are labelled with: the first served model, else the pool name.

        vLLM labels every metric with its first served model name whatever alias a request used.
        """
        return self.models[0] if self.models else self.name

    @property
    def kv_capacity(self) -> int:
        """Tokens the simulated KV cache holds."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        return self.max_model_len * _DEFAULT_KV_SEQUENCES

    @property
    def prefix_cache_blocks(self) -> int:
        """Blocks the prefix cache remembers: the KV cache's size in blocks (at least one)."""
        return max(1, self.kv_capacity // self.prefix_block_size)
