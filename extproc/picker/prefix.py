"""An approximate prefix index: which pods recently served which prompt prefixes.

vLLM's automatic prefix caching keeps the KV blocks of prompts a pod served recently; a new
prompt that starts the same way skips that part of prefill there. extproc cannot see a pod's
cache, so, like llm-d's approximate prefix-cache scorer (the Inference Extension's ``prefix``
plugin), it remembers what it sent where: the prompt's bytes are cut into fixed blocks, each
block's hash is *chained* (block i's hash covers blocks 0..i, so a pod holding it served a prompt
with this whole prefix), and each hash maps to the pods that recently served it, in one LRU
bounded by entry count.

It is approximate on purpose: an entry says "this replica sent that prefix there recently", not
that the pod still caches it (vLLM may have evicted it; another replica's traffic is not seen).
Hashes are Python's ``hash()`` of bytes: fast, and salted per process, so a client cannot
precompute colliding prompts; an index is never shared between processes, so the salt costs
nothing. A hash collision only misplaces one affinity hint.

Bounded work: at most :data:`MAX_BLOCKS` blocks of a prompt are hashed, looked up and recorded,
whatever its size. Bounded memory: at most ``max_entries`` (cluster, block) entries, each naming
at most :data:`MAX_PODS_PER_BLOCK` pods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_BYTES = 256
"""Bytes per block: about 64 tokens of English (~4 bytes a token), four of vLLM's 16-token KV
blocks. Smaller blocks resolve a shared prefix more finely but cost more hashes and entries per
prompt; a prompt shorter than one block gets no affinity (its prefill is cheap anyway)."""

MAX_BLOCKS = 128
"""Blocks considered per prompt: the first 32 KB. A shared prefix that matters (system prompt,
few-shot examples, a conversation's earlier turns) starts the prompt; beyond this a 1 MB prompt
would cost 4096 hashes for no better decision."""

MAX_ENTRIES = 200_000
"""Entries kept, over every cluster: ~13M tokens of prompt prefixes (64 tokens a block), the KV
caches of a few dozen GPUs. An entry costs 210 to 260 B (an OrderedDict slot and node, an int
key, a tuple of shared address strings; measured with tracemalloc, and bounded by
tests/extproc/picker/test_prefix.py), 56 B more when it names the most pods: 50 to 65 MB at most
per extproc process."""

MAX_PODS_PER_BLOCK = 8
"""Pods remembered per block, most recent first. A block this many pods served is *common* (a
system prompt every request carries): it gives no pod an edge, since the pods not listed served
it too, most likely. Without that rule the last few pods to serve a common prefix would draw
every request that carries it."""


def block_hashes(prompt: bytes, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS,
                 salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks (a trailing partial block is left out: a
    conversation grows by appending, so its earlier turns keep matching). ``salt`` is the
    request's vLLM ``cache_salt``: vLLM mixes it into the first block, so the pod's blocks of
    one salt never serve another, and the chain here starts from it for the same reason."""
    count = min(len(prompt) // block_bytes, max_blocks)
    hashes: list[int] = []
    chained = 0 if salt is None else hash(("cache_salt", salt))
    for start in range(0, count * block_bytes, block_bytes):
        chained = hash((chained, prompt[start:start + block_bytes]))
        hashes.append(chained)
    return hashes


class PrefixIndex:
    """Block hash -> the pods that recently served it, per cluster, in one bounded LRU."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max = max_entries
        # Keyed by hash((cluster, block hash)): one int per entry instead of a tuple, and clusters
        # never see each other's pods. Values: addresses, most recent first.
        self._entries: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, cluster: str, blocks: Sequence[int]) -> dict[str, float]:
        """Share (0 to 1) of ``blocks`` each pod holds as a leading run (its deepest block, not
        counting common ones); pods holding none are left out. Reading does not refresh
        entries: only a request sent does."""
        if not blocks:
            return {}
        held: dict[str, int] = {}
        get = self._entries.get
        for depth, block in enumerate(blocks, 1):
            pods = get(hash((cluster, block)))
            if pods is None:
                # Chained hashes: a pod holding a later block served this whole prefix, and
                # record() refreshes early blocks last, so a gap is (almost) always the end.
                break
            if len(pods) < MAX_PODS_PER_BLOCK:  # a common block credits nobody (see above)
                for pod in pods:
                    held[pod] = depth
        total = len(blocks)
        return {pod: depth / total for pod, depth in held.items()}

    def record(self, cluster: str, blocks: Sequence[int], address: str) -> None:
        """``address`` was sent a prompt with these blocks: remember it first for each."""
        entries = self._entries
        # Last block first, so block 0 ends as the most recent: eviction shortens a remembered
        # prefix from its end instead of cutting its head (which would hide the rest).
        for block in reversed(blocks):
            key = hash((cluster, block))
            pods = entries.get(key)
            if pods is None:
                entries[key] = (address,)
                continue
            if pods[0] != address:
                others = [pod for pod in pods if pod != address][:MAX_PODS_PER_BLOCK - 1]
                entries[key] = (address, *others)
            entries.move_to_end(key)
        while len(entries) > self._max:
            entries.popitem(last=False)
