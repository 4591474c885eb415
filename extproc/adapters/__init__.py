"""extproc's adapters: gRPC, protobuf and the process around the pure core (the
only modules of extproc that may touch them; tests/extproc/test_layers.py holds the line)."""
