"""The runtime both services stand on: settings, logging, the guarded Redis client, reload, gRPC
listen, the ops HTTP server, the worker supervisor and child processes, and the names that cross
process boundaries.

A leaf: it imports no service (``extproc``, ``ratelimit``), no config package (``routing``) and
not the CLI (``llm_sidecar``), so each of them may import it (tests/sidecar_runtime/test_leaf.py).
"""
