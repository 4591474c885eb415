"""A gRPC server of our own on asyncio: HTTP/2 frames parsed on the event loop, one task per
call, grpc.aio's servicer API (:mod:`.server`, :mod:`.connection`, :mod:`.call`,
:mod:`.frames`)."""

from sidecar_runtime.h2grpc.call import Context
from sidecar_runtime.h2grpc.server import Server, tls_context

__all__ = ["Context", "Server", "tls_context"]
