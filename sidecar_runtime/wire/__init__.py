"""What crosses process boundaries: hand-written protobuf bytes and the names (headers,
metadata keys) Envoy, extproc and ratelimit share."""
