"""Redis for both services: the client from a URL, our own pipelined connection, cluster
routing, and the one shielded call (deadline + circuit breaker) every backend call goes through."""
