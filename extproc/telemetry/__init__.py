"""What extproc reports about each request: the records and the interface that receives them
(:mod:`.events`), its Prometheus metrics and its log line, and which responses it reads to
measure (:mod:`.sampling`)."""
