"""The rate-limit service: Envoy RLS v3 on token buckets shared through Redis.

Dependencies run one way: ``errors`` / ``bucket`` (pure math) <- ``descriptors`` / ``document``
/ ``loader`` (config) <- ``store`` / ``memory_store`` / ``lua`` / ``redis_store`` / ``guard``
(buckets) <- ``limiter`` (decisions on plain types) <- ``wire`` (protobuf) <- ``service``
(grpc, the process) <- ``main`` (CLI flags and ``run``). ``reload`` and ``admin`` are glue.
"""
