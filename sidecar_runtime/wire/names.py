"""Names that cross process boundaries between Envoy, extproc and ratelimit, in one place.

A leaf module: it imports nothing of the project, so every package may import it.
"""

from __future__ import annotations

CLIENT_CREDENTIALS = ("authorization", "x-api-key", "api-key", "x-goog-api-key",
                      "proxy-authorization", "cookie")
"""Removed from every request to a pool (by the rendered routes, and by extproc for setups
whose routes ``render`` does not write): a client's credentials are the gateway's business,
not vLLM's (every pod would log or keep them). The first two are the keys extproc reads; the
others are where other SDKs put theirs (Azure OpenAI's ``api-key``, Google's
``x-goog-api-key``) and the browser's and proxies' own."""

METADATA_NAMESPACE = "llm_sidecar"
"""Envoy dynamic metadata namespace extproc writes and the rate-limit actions read."""
CLUSTER_METADATA_KEY = "cluster"
"""The pool extproc chose: the only thing Envoy's routes to a pool match on."""
TOKENS_METADATA_KEY = "llm_tokens"
"""The tokens a response used, set at its end only when known (absent: the reservation stands)."""
RESERVATION_METADATA_KEY = "llm_reservation"
"""The tokens a request reserves at admission (docs: Rate limits)."""
DONE_METADATA_KEY = "llm_done"
"""``"1"`` once the response reached its end (set with ``llm_tokens``, by extproc or by Envoy's
sse_to_metadata at end of stream): a stream cut after its usage chunk but before its end has
``llm_tokens`` without it, and is not settled."""
STRIP_USAGE_METADATA_KEY = "strip_usage"
"""``"1"``: extproc added ``stream_options.include_usage`` to this streamed request; Envoy's Lua
filter removes the usage chunk from what the client receives (it did not ask for it)."""
LEASE_METADATA_KEY = "llm_lease"
"""A random id per request naming its reservation and concurrency slot in the ratelimit store."""
CAP_METADATA_KEY = "llm_cap"
"""``"1"`` when a concurrency cap of the running config applies to the request: only then does
Envoy take a slot for it and make the stream-done call that frees it (the bootstrap carries
the concurrency actions of every level, so a cap added by a reload binds at once)."""

LEASE_ENTRY = "llm_sidecar.lease"
"""Rate-limit descriptor control entries: Envoy adds them from the metadata above, and the
ratelimit service takes them out before matching. ``lease`` names the request; ``used`` carries
the tokens its response used (the stream-done call settles the reservation); ``release`` frees
the lease's concurrency slot."""
USED_ENTRY = "llm_sidecar.used"
RELEASE_ENTRY = "llm_sidecar.release"
DONE_ENTRY = "llm_sidecar.done"
"""Carried by the settle descriptor from ``llm_done``: without it Envoy sends no settle."""
CAP_ENTRY = "llm_sidecar.cap"
"""Carried by the concurrency descriptors from ``llm_cap``: without it Envoy sends none."""
CONTROL_ENTRIES = frozenset({LEASE_ENTRY, USED_ENTRY, RELEASE_ENTRY, DONE_ENTRY, CAP_ENTRY})

LB_METADATA_NAMESPACE = "envoy.lb"
"""The Gateway API Inference Extension's endpoint picker protocol: the dynamic metadata
namespace the picked pods go in, where Envoy's override_host load balancer reads them."""
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
"""The protocol's key (in ``envoy.lb``) and request header: ``ip:port``, or ``ip:port,ip:port``
(the pick, then fallbacks in order). A client's own header of this name (or any name it
prefixes, like ``-subset``) is removed before any filter sees it."""
DESTINATION_ENDPOINT_SERVED = "x-gateway-destination-endpoint-served"
"""Set by Envoy (override_host's ``selected_host_key``, in ``envoy.lb``): the pod that served."""

LLM_HEADER_PREFIX = "x-llm-"
"""The prefix of the gateway's own headers: a client's copies are removed before anything reads
them (Envoy's early header mutation; extproc again, for Istio)."""
CLUSTER_HEADER = "x-llm-cluster"
MODEL_HEADER = "x-llm-model"
TENANT_HEADER = "x-llm-tenant"
KEY_ID_HEADER = "x-llm-key-id"
CONTEXT_LENGTH_HEADER = "x-llm-context-length"
PRIORITY_HEADER = "x-llm-priority"
VARIANT_HEADER = "x-llm-variant"
"""Set by extproc on a request it routes, for Envoy's rate-limit actions, logs and the pool
(docs: Headers); ``x-llm-cluster`` names the pool the route's metadata match already chose."""
CACHE_HEADER = "x-llm-cache"
"""To the client, on embeddings: ``hit``, ``partial``, ``miss`` or ``bypass``."""
QUEUED_HEADER = "x-llm-queued-ms"
"""To the client, on answers to requests that waited for a pod with room (flow control):
milliseconds waited."""
RATELIMIT_BACKEND_HEADER = "x-llm-ratelimit-backend"
"""``unavailable`` on the rate limiter's answer when it decided without its store
(``on_backend_error: deny``): Envoy's local-reply mapper turns such a 429 into a 503, and so
does extproc for a cache hit's check (``extproc.hit_limits.answer``)."""

ENVOY_USAGE_HEADER = "x-llm-envoy-usage"
"""Added by the bootstrap ``render`` writes, after every client ``x-llm-*`` header is gone, when
its Envoy carries the usage filters (``telemetry.envoy_usage``): only then does extproc leave
an unsampled stream's usage to Envoy. An Envoy without them (Istio's EnvoyFilter) sends no
marker, so extproc reads those streams itself, whatever the YAML says."""

BOOTSTRAP_HEADER = "x-llm-bootstrap"
"""Added by the bootstrap ``render`` writes (after every client ``x-llm-*`` header is gone): a
fingerprint of that bootstrap, which extproc compares with the one its own config renders, to
tell when Envoy runs a bootstrap its routing YAML no longer describes."""

GRPC_MAX_CONCURRENT_STREAMS = 100
"""Streams one HTTP/2 connection to extproc or ratelimit carries at once: the services' gRPC
server advertises it (and refuses a stream beyond it), and the rendered Envoy clusters keep to
it, so Envoy opens another connection instead. ext_proc holds a stream per request in flight,
so under load Envoy's connections multiply and the kernel spreads them over ``--workers``."""
UNIX_PREFIX = "unix:"
"""A service address that names a Unix socket: ``unix:/absolute/path`` (gRPC's scheme, and what
the rendered Envoy config turns into a ``pipe`` address)."""
