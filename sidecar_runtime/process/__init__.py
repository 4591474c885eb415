"""The process around a service: settings, logs, the service skeleton, workers, reload,
the ops HTTP server, child processes and signals."""
