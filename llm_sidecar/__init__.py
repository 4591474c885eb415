"""llm_sidecar package."""
