"""routing package."""
