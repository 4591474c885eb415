"""Building snapshots for extproc unit tests without files."""

from __future__ import annotations

from typing import Any

from extproc.actions import Hold, Waited
from extproc.picker.pick import EndpointPicker, Pick, Priority
from extproc.picker.scoring import NO_WORK, Work
from routing.compiled import Snapshot, compile_config
from routing.loader import validate
from routing.yamlsrc import Located

BASE: dict[str, Any] = {
    "version": 1,
    "clusters": {
        "vllm-short": {"endpoints": ["10.0.0.11:8000"], "max_context": 2048},
        "vllm-long": {"endpoints": ["10.0.0.12:8000"], "max_context": 32768},
        "vllm-canary": {"endpoints": ["10.0.0.13:8000"], "max_context": 32768},
        "embed": {"endpoints": ["10.0.0.14:8000"], "max_context": 8192},
    },
    "models": {
        "llama-2-13b": {"clusters": ["vllm-short", "vllm-long"], "default_max_tokens": 256},
        "bge-m3": {"kind": "embedding", "clusters": ["embed"]},
    },
    # Every response read (as before issue 16); tests of the unread path set their own.
    "telemetry": {"sample": 1},
}


JSON_POST = {":method": "POST", "content-type": "application/json"}
"""The headers of a request with a JSON body, as clients send it (extproc refuses a body of any
other media type, as vLLM does)."""


def snapshot(**sections: Any) -> Snapshot:
    doc = {**BASE, **sections}
    return compile_config(validate(Located("test.yaml", doc, {})))


class Unqueued:
    """An :class:`EndpointPicker` as a request sees it, for tests whose pools have no flow
    control (the runtime's queue needs an event loop; these tests call the stream directly)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    def pick(self, cluster: str, prompt: bytes, priority: Priority, salt: str | None = None,
             work: Work = NO_WORK, room_only: bool = False) -> Pick | None:
        return self.picker.pick(cluster, prompt, priority, salt, work, room_only)

    def done(self, cluster: str, address: str, unread: bool = False) -> None:
        self.picker.done(cluster, address, unread)

    def answered(self, cluster: str, address: str, status: int) -> bool:
        return self.picker.answered(cluster, address, status)

    def must_wait(self, cluster: str) -> bool:
        return False

    async def wait(self, hold: Hold) -> Waited:
        raise AssertionError(f"{hold.cluster} is not flow-controlled in this test")
