"""The bounded log of API requests the simulator received, for tests to inspect.

Served at ``GET /sim/requests`` (a simulator-only endpoint, not part of vLLM's API) as a JSON list,
oldest first, each entry::

    {"seq": 1, "time": 1730000000.123, "method": "POST", "path": "/v1/embeddings",
     "query": {}, "headers": {"content-type": "application/json", ...}, "body": {...}}

``headers`` has lowercase names (repeated headers joined with ``", "``); ``body`` is the parsed
JSON, or ``null`` when there was no body or it was not JSON. ``DELETE /sim/requests`` empties it.

Credentials (``authorization``, ``x-api-key``, ``proxy-authorization``, ``cookie``) are never
kept: the journal holds ``redacted sha256:<first 12 hex digits>`` of the value instead, enough
for a test to tell which key arrived, useless to whoever reads the journal.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_LIMIT = 10_000
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie"})


def redacted(value: str) -> str:
    """What the journal keeps of a credential: a short fingerprint, never the value."""
    return "redacted sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


def header_dict(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Headers keyed by lowercase name, repeated values joined with ``", "`` as HTTP allows."""
    merged: dict[str, str] = {}
    for name, value in pairs:
        key = name.lower()
        merged[key] = f"{merged[key]}, {value}" if key in merged else value
    return merged


class RequestJournal:
    """The last ``limit`` requests, oldest first."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=limit)
        self._seq = itertools.count(1)

    def record(
        self,
        method: str,
        path: str,
        query: Mapping[str, str],
        headers: Mapping[str, str],
        body: object,
    ) -> None:
        """Append one request; the oldest falls off past the limit."""
        self._entries.append(
            {
                "seq": next(self._seq),
                "time": time.time(),
                "method": method,
                "path": path,
                "query": dict(query),
                "headers": {k: redacted(v) if k.lower() in CREDENTIAL_HEADERS else v
                            for k, v in headers.items()},
                "body": body,
            }
        )

    def entries(self) -> list[dict[str, Any]]:
        """A snapshot of the recorded requests."""
        return list(self._entries)

    def clear(self) -> int:
        """Forget every recorded request; returns how many there were."""
        count = len(self._entries)
        self._entries.clear()
        return count
