"""ratelimit package."""
