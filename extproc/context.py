"""Per-request facts gathered from the request headers, shared by a stream's processor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from extproc.actions import Hold, Waited
from extproc.canary.policy import OPEN_CANARIES, CanaryPolicy
from extproc.identity import Identity
from extproc.picker.pick import Pick, Priority
from extproc.picker.scoring import NO_WORK, Work
from extproc.quick_init import quick_init
from extproc.sampling import ReadFloor
from routing.compiled import Snapshot
from sidecar_runtime.wire.names import (
    BOOTSTRAP_HEADER,
    DESTINATION_ENDPOINT,
    ENVOY_USAGE_HEADER,
    LLM_HEADER_PREFIX,
)


class EndpointPicking(Protocol):
    """The endpoint picker as a request sees it (:class:`extproc.picker.runtime.PickerRuntime`)."""

    def pick(self, cluster: str, prompt: bytes, priority: Priority,
             salt: str | None = None, work: Work = NO_WORK,
             room_only: bool = False) -> Pick | None: ...
    def done(self, cluster: str, address: str, unread: bool = False) -> None: ...
    def answered(self, cluster: str, address: str, status: int) -> bool: ...
    def must_wait(self, cluster: str) -> bool: ...
    async def wait(self, hold: Hold) -> Waited: ...


@quick_init
@dataclass(frozen=True)
class RequestContext:
    snapshot: Snapshot
    method: str
    path: str
    headers: Mapping[str, str]
    identity: Identity
    request_id: str
    started: float
    """Monotonic seconds when the request headers reached extproc."""
    clock: Callable[[], float]
    canaries: CanaryPolicy = OPEN_CANARIES
    """The canaries in force, read once when the request started (a guard may stop one)."""
    picker: EndpointPicking | None = None
    """Picks the pod of ``endpoint_picker`` pools; None: Envoy balances every pool."""
    read_floor: ReadFloor | None = None
    """The process's ``telemetry.sample_min_per_s`` budget; None: the share alone."""

    def sticky_value(self, sticky: str) -> str:
        if sticky == "tenant":
            return self.identity.tenant
        if sticky == "request":
            return self.request_id
        return self.identity.key_id


def spoofed_headers(headers: Mapping[str, str]) -> tuple[str, ...]:
    """Inbound ``x-llm-*`` and endpoint-picker (``x-gateway-destination-endpoint*``) headers:
    only extproc may set them, so they are removed first. Not Envoy's own
    ``x-llm-envoy-usage`` (a client's copy is gone before Envoy adds it; a spoofed one could
    only leave the spoofer's own stream unsettled, its reservation standing) nor
    ``x-llm-bootstrap`` (a spoofed one, possible only where ``render``'s bootstrap does not
    run, could only raise the stale-bootstrap warning)."""
    return tuple(name for name in headers
                 if name.startswith(_SPOOFABLE) and name not in _ENVOYS_OWN)


_ENVOYS_OWN = frozenset((ENVOY_USAGE_HEADER, BOOTSTRAP_HEADER))


_SPOOFABLE = (LLM_HEADER_PREFIX, DESTINATION_ENDPOINT)
"""One ``startswith`` per header (Envoy's usage header starts with the first only)."""
