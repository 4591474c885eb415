"""extproc package."""
