"""hpack internals the gRPC server's header cache reads (hpack>=4,<5).

:class:`sidecar_runtime.h2grpc.head.HeadReader` caches a decoded header block only while the
decoder's dynamic table is empty and its size unchanged: a block that refers to no table entry
decodes the same every time. hpack has no public way to ask either.
"""

from __future__ import annotations

import hpack

if not hasattr(hpack.Decoder(), "header_table") or not hasattr(
        hpack.Decoder().header_table, "dynamic_entries"):
    raise ImportError("hpack's Decoder no longer has header_table.dynamic_entries: "  # pragma: no cover
                      "sidecar_runtime.h2grpc needs hpack>=4,<5 (pyproject.toml)")


def table_state(decoder: hpack.Decoder) -> tuple[bool, int]:
    """(is the dynamic table empty, the table's size setting) of ``decoder``."""
    return not decoder.header_table.dynamic_entries, decoder.header_table_size
