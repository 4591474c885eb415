"""Names that cross process boundaries between Envoy, extproc and ratelimit, in one place.

A leaf module: it imports nothing of the project, so every package may import it.
"""

from __future__ import annotations

METADATA_NAMESPACE = "llm_sidecar"
"""Envoy dynamic metadata namespace extproc writes and the rate-limit actions read."""
CLUSTER_METADATA_KEY = "cluster"
"""The pool extproc chose: the only thing Envoy's routes to a pool match on."""
TOKENS_METADATA_KEY = "llm_tokens"
"""The tokens a response used, set at its end only when known (absent: the reservation stands)."""
RESERVATION_METADATA_KEY = "llm_reservation"
"""The tokens a request reserves at admission (CONTRACT §7)."""
LEASE_METADATA_KEY = "llm_lease"
"""A random id per request naming its reservation and concurrency slot in the ratelimit store."""

LEASE_ENTRY = "llm_sidecar.lease"
"""Rate-limit descriptor control entries: Envoy adds them from the metadata above, and the
ratelimit service takes them out before matching. ``lease`` names the request; ``used`` carries
the tokens its response used (the stream-done call settles the reservation); ``release`` frees
the lease's concurrency slot."""
USED_ENTRY = "llm_sidecar.used"
RELEASE_ENTRY = "llm_sidecar.release"
CONTROL_ENTRIES = frozenset({LEASE_ENTRY, USED_ENTRY, RELEASE_ENTRY})
