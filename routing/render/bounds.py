"""What bounds the memory and connections of the rendered Envoy: its overload manager, the
listener's buffer limit and the HTTP/2 limits of the client listener.

ext_proc buffers every request body whole (``request_body_mode: BUFFERED``), up to the
stream's buffer limit, which Envoy takes from the listener's per-connection buffer limit
(``envoy.max_request_bytes``). An HTTP/1.1 connection carries one stream at a time; an HTTP/2
connection carries up to ``max_concurrent_streams``, each with its own buffer of that size, so
the streams cap is what bounds one connection. Per Envoy, connections times that is far more
than any container holds: the heap monitor is the bound there.
"""

from __future__ import annotations

from typing import Any

from routing.render.clusters import TYPE
from routing.schema import EnvoySection

MONITOR_API = "type.googleapis.com/envoy.extensions.resource_monitors."
CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"
HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"
SHRINK_HEAP = "envoy.overload_actions.shrink_heap"
RESET_STREAMS = "envoy.overload_actions.reset_high_memory_stream"
STOP_ACCEPTING = "envoy.overload_actions.stop_accepting_requests"

SHRINK_AT = 0.90
"""Heap pressure (heap in use / ``max_heap_bytes``) from which tcmalloc returns free pages to
the system and the streams holding the most buffered bytes start being reset."""
STOP_AT = 0.95
"""Heap pressure from which Envoy answers every new request 503 (``OM`` in the access log)."""
RESET_SATURATED_AT = 0.98
"""Heap pressure at which every stream holding at least :data:`TRACKED_STREAM_BYTES` may be
reset (between :data:`SHRINK_AT` and this, the largest first)."""
TRACKED_STREAM_BYTES_LOG2 = 20
"""Streams buffering at least 2^20 bytes (1 MiB) are tracked for reset: an LLM request is a few
KB to a few hundred KB, so these are the bodies an attacker inflates to fill the heap."""

H2_MIN_WINDOW = 65_535
"""The smallest HTTP/2 flow-control window (RFC 9113's initial window; Envoy's minimum)."""
HTTP2_CONNECTION_WINDOW = 4 * 1024 * 1024
"""Bytes a client may send on one HTTP/2 connection, all streams together, before Envoy
acknowledges them (Envoy's default: 256 MiB)."""
REFRESH_INTERVAL = "0.25s"
"""How often the overload manager reads its monitors (Envoy's default is 1 s): a heap filling
at 100 MB/s overshoots by a quarter of that at most."""


def _threshold(monitor: str, value: float) -> list[dict[str, Any]]:
    return [{"name": monitor, "threshold": {"value": value}}]


def heap_actions() -> list[dict[str, Any]]:
    """The overload actions the heap monitor drives (rendered only with ``max_heap_bytes``)."""
    return [
        {"name": SHRINK_HEAP, "triggers": _threshold(HEAP_MONITOR, SHRINK_AT)},
        {"name": RESET_STREAMS, "triggers": [{"name": HEAP_MONITOR, "scaled": {
            "scaling_threshold": SHRINK_AT, "saturation_threshold": RESET_SATURATED_AT}}]},
        {"name": STOP_ACCEPTING, "triggers": _threshold(HEAP_MONITOR, STOP_AT)},
    ]


def overload_manager(envoy: EnvoySection) -> dict[str, Any]:
    """The bootstrap's ``overload_manager``.

    Always Envoy's global cap on open downstream connections (without one, a flood of idle or
    slow clients runs the process out of file descriptors, and Envoy warns at start-up; a
    connection past the cap is closed as soon as it is accepted). With ``max_heap_bytes``, also
    the fixed_heap monitor and its actions: shrink the heap, reset the biggest streams, stop
    accepting requests; new requests are accepted again once the pressure falls below 95%.
    """
    monitors: list[dict[str, Any]] = [{
        "name": CONNECTIONS_MONITOR,
        "typed_config": {
            TYPE: MONITOR_API + "downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": envoy.max_connections,
        },
    }]
    out: dict[str, Any] = {"resource_monitors": monitors}
    if envoy.max_heap_bytes is None:
        return out
    monitors.append({
        "name": HEAP_MONITOR,
        "typed_config": {TYPE: MONITOR_API + "fixed_heap.v3.FixedHeapConfig",
                         "max_heap_size_bytes": envoy.max_heap_bytes},
    })
    out["refresh_interval"] = REFRESH_INTERVAL
    out["actions"] = heap_actions()
    # reset_high_memory_stream needs Envoy to track each stream's buffers.
    out["buffer_factory_config"] = {
        "minimum_account_to_track_power_of_two": TRACKED_STREAM_BYTES_LOG2}
    return out


def stream_window(envoy: EnvoySection) -> int:
    """The HTTP/2 stream window, which is also each HTTP/2 stream's buffer limit.

    Envoy gives an HTTP/2 stream the larger of the listener's buffer limit and this window as
    its buffer limit (measured: with Envoy's default window, 256 MiB, a 200 KB body passed a
    64 KiB ``max_request_bytes`` over h2c while HTTP/1.1 got its 413). So the window is the
    body limit, never above it, and never below HTTP/2's minimum window.
    """
    return max(H2_MIN_WINDOW, envoy.max_request_bytes)


def http2_options(envoy: EnvoySection) -> dict[str, Any]:
    """The client listener's ``http2_protocol_options`` (h2c and, behind TLS, h2)."""
    return {
        "max_concurrent_streams": envoy.max_concurrent_streams,
        "initial_stream_window_size": stream_window(envoy),
        "initial_connection_window_size": HTTP2_CONNECTION_WINDOW,
    }

