"""Reading a routing YAML into a validated :class:`RoutingConfig`, with every problem located.

``check_config`` is what ``llm-sidecar check`` runs: it reports all problems it can find at once,
each as ``FILE:LINE: message``, and returns the warnings of a config that loads.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from routing.errors import ConfigError, Problem
from routing.ratelimits import UINT32_MAX, limit_entries
from routing.schema import TENANT_RULE, Limit, RoutingConfig, is_tenant
from routing.units import parse_hostport, parse_rate
from routing.yamlsrc import Located, Path, read_yaml
from sidecar_runtime.wire.names import UNIX_PREFIX


def load_config(path: str) -> RoutingConfig:
    """Parse, validate and cross-check the routing YAML at ``path``."""
    located = read_yaml(path)
    return validate(located)


def check_config(path: str) -> list[Problem]:
    """What ``llm-sidecar check`` runs: raises :class:`ConfigError` like :func:`load_config`,
    else returns the warnings (a config that loads but is likely not what was meant)."""
    located = read_yaml(path)
    return warnings(validate(located), located)


def warnings(config: RoutingConfig, located: Located) -> list[Problem]:
    """Problems that do not stop the config from running, each ``FILE:LINE: warning: ...``."""
    out: list[Problem] = []
    for name, model in config.models.items():
        largest = max(config.clusters[c].max_context for c in model.clusters)
        if model.kind == "chat" and model.default_max_tokens >= largest:
            out.append(located.problem(
                ("models", name, "default_max_tokens"),
                f"warning: default_max_tokens {model.default_max_tokens} leaves no room for a "
                f"prompt in the largest pool of {name!r} (max_context {largest}): every "
                "request without max_tokens gets a 413; use less than max_context"))
    if config.auth.required:
        if not config.api_keys:
            out.append(located.problem(
                ("auth", "required"),
                "warning: auth.required is true and no api_keys are listed: every request "
                "gets 401 invalid_api_key; list the keys (name and sha256) under api_keys"))
        return out  # every warning below is about open mode
    if config.api_keys:
        out.append(located.problem(
            ("api_keys",),
            "warning: api_keys are listed but auth.required is false: any other caller is let "
            f"in and names its own tenant with the {config.auth.tenant_header} header; set "
            "auth.required: true in production"))
    # A scope of tenant keeps apart only the tenants callers cannot name.
    cached = [name for name, model in config.models.items()
              if model.cache is not None and model.cache.scope == "tenant"]
    salted = [name for name, model in config.models.items()
              if model.prefix_cache_scope == "tenant"]
    for scoped, setting, path, given, kept in (
            (cached, "cache scope", ("cache", "scope"), "reads that tenant's cached vectors",
             "entries"),
            (salted, "prefix_cache_scope", ("prefix_cache_scope",),
             "gets that tenant's cache_salt and can time its prompts", "prefixes")):
        if scoped:
            out.append(located.problem(
                ("models", scoped[0], *path),
                f"warning: {setting} tenant with auth.required false keeps apart only tenants "
                "callers cannot name: any unlisted caller names its own tenant "
                f"({config.auth.tenant_header}) and {given}. Set auth.required: true where "
                f"tenants must not see each other's {kept}"))
    # Which levels enforce, as the rate limiter reads them (an override inherits shadow).
    enforcing = {entry.level for entry in limit_entries(config) if not entry.shadow}
    levels = [name for name in ("api_key", "tenant") if name in enforcing]
    if levels:
        out.append(located.problem(
            ("rate_limits", levels[0]),
            f"warning: {' and '.join(levels)} limits with auth.required false bind only "
            "callers that keep their key and tenant: any caller can send a new key or "
            f"name a new tenant ({config.auth.tenant_header}) and get fresh buckets; only "
            "model limits bind everyone. Set auth.required: true where they must hold"))
    return out


def local_listeners(config: RoutingConfig) -> list[tuple[Path, str]]:
    """(where in the YAML, ``host:port``) of every TCP port the gateway's own processes listen
    on: Envoy's listener and admin, the services (ratelimit only with ``rate_limits``; a Unix
    socket is no port), and the endpoints of the simulated pools (which ``up`` and the
    renders run there)."""
    found: list[tuple[Path, str]] = [(("envoy", "listen"), config.envoy.listen),
                                     (("envoy", "admin"), config.envoy.admin)]
    for kind in ("extproc", "ratelimit") if config.rate_limits is not None else ("extproc",):
        address = getattr(config.services, kind)
        if not address.startswith(UNIX_PREFIX):
            found.append((("services", kind), address))
    for name, spec in config.clusters.items():
        if spec.simulator is not None:
            found += [(("clusters", name, "endpoints", i), endpoint)
                      for i, endpoint in enumerate(spec.endpoints)]
    return found


def _local_ports(config: RoutingConfig, add: Callable[[Path, str], None]) -> None:
    """Two of :func:`local_listeners` on one port of one host."""
    used: dict[int, list[tuple[str, str]]] = {}
    for path, address in local_listeners(config):
        what = f"{path[1]}'s endpoint {address}" if path[0] == "clusters" \
            else ".".join(map(str, path))
        host, port = parse_hostport(address)
        if not _local_host(host):
            continue
        # One port, on one address or on all of them (a wildcard): two listeners cannot.
        first = next((w for h, w in used.get(port, ())
                      if h == host or h in _WILDCARD or host in _WILDCARD), None)
        used.setdefault(port, []).append((host, what))
        if first is None:
            continue
        if first == what:  # one pool's endpoint, listed twice
            add(path, f"{path[1]} lists endpoint {address} twice: list it once")
        else:
            add(path, f"{what} and {first} both use port {port}: give each its own")


_WILDCARD = frozenset({"", "0.0.0.0", "::", "[::]"})


def _local_host(host: str) -> bool:
    return host in _WILDCARD or host == "localhost" or host.startswith("127.") \
        or host in ("::1", "[::1]")


def validate(located: Located) -> RoutingConfig:
    """Validate already-parsed YAML; raises :class:`ConfigError` listing every problem."""
    if not isinstance(located.data, dict):
        raise ConfigError([located.problem((), "the file must be a mapping with version: 1")])
    try:
        config = RoutingConfig.model_validate(located.data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_problems(exc, located)) from None
    problems = cross_check(config, located)
    if problems:
        raise ConfigError(problems)
    return config


def _allowed_keys(loc: Path) -> list[str]:
    """Field names of the model that owns ``loc`` (for "did you mean" hints)."""
    model: type[BaseModel] | None = RoutingConfig
    for part in loc[:-1]:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        if field is None:
            continue  # a dict key (cluster or model name) or list index
        model = _model_of(field.annotation)
    return list(model.model_fields) if model is not None else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


_MISSING_HINTS = {
    "version": "write version: 1 at the top",
    "clusters": "the vLLM pools, by name",
    "models": "the model names clients send, each with its clusters",
    "max_context": "the longest context the pool serves: its vLLM --max-model-len",
    "endpoints": "host:port of each vLLM server of the pool",
    "model": "the model name the canary serves",
    "cluster": "the pool the canary runs on",
    "namespace": "models that name the same namespace share cached vectors",
    "name": "how overrides and logs refer to the key",
    "sha256": "sha256 hex of the secret key: echo -n KEY | sha256sum",
}


def _pydantic_problems(exc: ValidationError, located: Located) -> list[Problem]:
    problems: list[Problem] = []
    for err in exc.errors():
        loc: Path = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            key = str(loc[-1])
            where = ".".join(str(p) for p in loc[:-1]) or "top level"
            hint = _hint(key, _allowed_keys(loc))
            message = f"unknown key {key!r} in {where}{hint}"
        elif kind == "missing":
            why = _MISSING_HINTS.get(str(loc[-1]))
            message = f"missing required key {dotted}" + (f" ({why})" if why else "")
        elif kind == "literal_error" and loc == ("version",):
            message = "version must be 1"
        elif kind == "too_short" and len(loc) == 3 and loc[0] == "models" and loc[2] == "clusters":
            clusters = located.data.get("clusters")
            known = ", ".join(map(str, clusters)) if isinstance(clusters, dict) else ""
            message = (f"model {loc[1]!r} has no clusters: list the pools that serve it "
                       f"(known clusters: {known or 'none yet'})")
        elif kind == "too_short" and loc in (("clusters",), ("models",)):
            message = f"{loc[0]} is empty: define at least one"
        elif loc[-1] == "percent" and (kind in ("less_than_equal", "greater_than_equal",
                                                "float_parsing", "float_type")
                                       or isinstance(err["input"], bool)):
            message = (f"{dotted}: {err['input']!r} is not a percentage: use 0 to 100 "
                       "(5 sends 5% of the sticky keys to the canary)")
        else:
            text = str(err["msg"]).removeprefix("Value error, ")
            message = f"{dotted}: {text}"
        problems.append(located.problem(loc, message))
    return problems


def _hint(key: str, allowed: list[str], label: str = "allowed") -> str:
    """`` (did you mean 'x'?)`` for a near miss, else the list of what ``key`` may be."""
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if allowed:
        return f" ({label}: {', '.join(allowed)})"
    return "" if label == "allowed" else f" (there are no {label})"


def cross_check(config: RoutingConfig, located: Located) -> list[Problem]:
    """Problems that span sections: references, overlaps and duplicates."""
    problems: list[Problem] = []

    def add(path: Path, message: str) -> None:
        problems.append(located.problem(path, message))

    for name, model in config.models.items():
        for i, cluster in enumerate(model.clusters):
            if cluster not in config.clusters:
                add(("models", name, "clusters", i),
                    f"model {name!r} names unknown cluster {cluster!r}"
                    f"{_hint(cluster, list(config.clusters), 'known clusters')}")
        sizes = Counter(config.clusters[c].max_context for c in model.clusters if c in config.clusters)
        for size, count in sizes.items():
            if count > 1:
                add(("models", name, "clusters"),
                    f"model {name!r} has {count} clusters with max_context {size}: pools overlap, "
                    "give each pool of a model its own max_context")
        if len(set(model.clusters)) != len(model.clusters):
            add(("models", name, "clusters"), f"model {name!r} lists a cluster twice")
        if model.canary is not None:
            canary = model.canary
            if canary.cluster not in config.clusters:
                add(("models", name, "canary", "cluster"),
                    f"canary of {name!r} names unknown cluster {canary.cluster!r}"
                    f"{_hint(canary.cluster, list(config.clusters), 'known clusters')}")
            if canary.model == name:
                add(("models", name, "canary", "model"), "the canary model must differ from the model")
            elif canary.model in config.models:
                add(("models", name, "canary", "model"),
                    f"canary model {canary.model!r} is also a model: names overlap")
        if model.cache is not None and model.kind != "embedding":
            add(("models", name, "cache"),
                f"cache is only for kind: embedding models ({name!r} is {model.kind})")

    fallback = config.services.fallback_cluster
    if fallback is not None:
        if fallback not in config.clusters:
            add(("services", "fallback_cluster"), f"fallback_cluster names unknown cluster "
                f"{fallback!r}{_hint(fallback, list(config.clusters), 'known clusters')}")
        if not config.services.failure_mode_allow:
            add(("services", "fallback_cluster"), "fallback_cluster is only used when extproc "
                "fails open: set services.failure_mode_allow: true (or remove it)")

    _local_ports(config, add)

    owners: dict[str, str] = {}
    for name, spec in config.clusters.items():
        for i, endpoint in enumerate(spec.endpoints):
            first = owners.setdefault(endpoint, name)
            first_context = config.clusters[first].max_context
            if first != name and first_context != spec.max_context:
                add(("clusters", name, "endpoints", i),
                    f"endpoint {endpoint} is in pools {first!r} (max_context {first_context}) and "
                    f"{name!r} (max_context {spec.max_context}): pools overlap, and one vLLM "
                    "server has one --max-model-len; list it in one pool")

    seen_names: dict[str, int] = {}
    seen_hashes: dict[str, str] = {}
    for i, key in enumerate(config.api_keys):
        if key.name in seen_names:
            add(("api_keys", i, "name"),
                f"api key name {key.name!r} is used twice (first at line "
                f"{located.line_of(('api_keys', seen_names[key.name]))}): names must be unique")
        if key.sha256 in seen_hashes:
            add(("api_keys", i, "sha256"),
                f"api key {key.name!r} has the same sha256 as {seen_hashes[key.sha256]!r}: one "
                "secret can be one key only; give each key its own secret, or remove one")
        seen_names.setdefault(key.name, i)
        seen_hashes.setdefault(key.sha256, key.name)

    limits = config.rate_limits
    if limits is not None:
        for level, known in (("api_key", [k.name for k in config.api_keys]),
                             ("model", list(config.models))):
            section = getattr(limits, level)
            if section is None:
                continue
            for override in section.overrides:
                if override not in known:
                    what, label = (("api key name", "api key names under api_keys")
                                   if level == "api_key" else ("model", "known models"))
                    add(("rate_limits", level, "overrides", override),
                        f"rate_limits.{level} overrides unknown {what} {override!r}"
                        f"{_hint(override, known, label)}")
        for tenant in limits.tenant.overrides if limits.tenant is not None else ():
            if not is_tenant(tenant):
                add(("rate_limits", "tenant", "overrides", tenant),
                    f"rate_limits.tenant overrides {tenant!r}, a tenant no request can have: a "
                    f"tenant is {TENANT_RULE}")
        for level in ("api_key", "tenant", "model"):
            section = getattr(limits, level)
            if section is None:
                continue
            entries: list[tuple[Path, Limit]] = (
                [(("default",), section.default)] if section.default else [])
            entries += [(("overrides", k), v) for k, v in section.overrides.items()]
            for sub, limit in entries:
                sets_a_limit = (limit.requests, limit.tokens, limit.concurrent) != (None, None, None)
                # An override may only change shadow: it then inherits the default's limits.
                only_shadow = sub[0] == "overrides" and section.default is not None \
                    and limit.shadow is not None
                if not sets_a_limit and not only_shadow:
                    add(("rate_limits", level, *sub),
                        "a limit needs requests, tokens, concurrent or a combination")
                if limit.burst is not None and limit.requests is None:
                    add(("rate_limits", level, *sub, "burst"),
                        "burst is the capacity of the requests bucket: it needs a requests rate")
                problems.extend(_above_uint32(located, ("rate_limits", level, *sub), limit))

    if config.priority.high_below > config.priority.low_from:
        add(("priority", "high_below"), "priority.high_below must not be above priority.low_from")
    return problems


def _above_uint32(located: Located, at: Path, limit: Limit) -> list[Problem]:
    """Amounts the rate-limit service cannot hold: Envoy's rate-limit API carries a limit in
    32 bits, and a descriptor file is held to the same bound (``ratelimit.loader``)."""
    out: list[Problem] = []
    for field in ("requests", "tokens"):
        text = getattr(limit, field)
        if text is not None and parse_rate(text).amount > UINT32_MAX:
            out.append(located.problem((*at, field), (
                f"{field} {text!r} is more than {UINT32_MAX} per window, the most Envoy's "
                "rate-limit API carries: use a shorter window")))
    for field in ("burst", "concurrent"):
        number = getattr(limit, field)
        if number is not None and number > UINT32_MAX:
            out.append(located.problem((*at, field), (
                f"{field} {number} is more than {UINT32_MAX}, the most Envoy's rate-limit API "
                "carries")))
    return out
