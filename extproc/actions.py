"""What the stream state answers each ext_proc message with, as plain frozen values.

:mod:`extproc.wire` turns these into protobuf; nothing else in the package sees protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Phase = Literal["request_headers", "request_body", "response_headers", "response_body"]
Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ModeOverride:
    """Processing-mode change for the rest of this stream (needs ``allow_mode_override``)."""

    response_headers: bool = True
    response_body: Literal["none", "streamed", "buffered"] = "none"


@dataclass(frozen=True)
class Continue:
    """Let the message through, with optional header and body changes."""

    set_headers: Headers = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    clear_route_cache: bool = False
    mode: ModeOverride | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    """Dynamic metadata to hand Envoy (for example LLM tokens to charge at stream end)."""


@dataclass(frozen=True)
class Reply:
    """Answer the client now (ImmediateResponse); nothing reaches the upstream."""

    status: int
    body: bytes
    headers: Headers = (("content-type", "application/json"),)
    details: str = ""


Action = Continue | Reply

PASS = Continue()
