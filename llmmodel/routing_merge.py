"""The routing YAML ``onboard`` writes: an operator's routing YAML plus each planned model's
pools, model entry, canary and rate limits.

Nothing of the base is overwritten: a model or pool name it already has, or a limit it sets
otherwise than an LLMModel does, is a ``FILE:LINE`` error at the LLMModel, so a declared model
never silently replaces what an operator wrote by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.spec import LoadedModel, canary_problems
from routing.errors import ConfigError, Problem
from routing.loader import validate
from routing.picker_schema import MAX_WAIT_LIMIT_S
from routing.render import dump
from routing.schema import Limit, ServicesSection
from routing.yamlsrc import Path, load_yaml

POOL_PORT = 8000
"""vLLM's OpenAI server port in the pods ``llmmodel.k8s`` writes."""

Endpoints = Callable[[PoolPlan], list[str]]


def default_endpoints(pool: PoolPlan, namespace: str) -> list[str]:
    """The pool's headless Service: its DNS name resolves to every ready pod, and Envoy's
    strict-DNS cluster follows the pods as they come and go."""
    return [f"{pool.name}.{namespace}.svc.cluster.local:{POOL_PORT}"]


def canary_targets(plans: Sequence[ModelPlan]) -> dict[str, ModelPlan]:
    """Declared models that are another declared model's canary, by name: the stable model
    names them under ``canary.model`` and they name it under ``canaryOf`` (both, so that no
    LLMModel can take another team's model away from its clients). They get their pools but no
    ``models`` entry of their own: the routing YAML serves a canary model only through its
    stable model (a canary model that is also a model is an overlap)."""
    by_name = {plan.name: plan for plan in plans}
    out: dict[str, ModelPlan] = {}
    for plan in plans:
        canary = plan.model.spec.canary
        target = by_name.get(canary.model) if canary is not None else None
        if target is not None and target is not plan and target.model.spec.canary_of == plan.name:
            out[target.name] = target
    return out


def merge_routing(base: dict[str, Any], plans: Sequence[ModelPlan], *,
                  endpoints: Callable[[PoolPlan], list[str]],
                  simulate: bool = False) -> dict[str, Any]:
    """A new routing document: ``base`` (not changed) with the plans' clusters, models and
    limits added. Raises :class:`ConfigError` at the LLMModel for every clash."""
    doc = copy.deepcopy(base)
    clusters: dict[str, Any] = dict(doc.get("clusters") or {})
    models: dict[str, Any] = dict(doc.get("models") or {})
    problems: list[Problem] = canary_problems([plan.model for plan in plans])
    _check_names(base, plans, problems)
    canaries = canary_targets(plans)
    by_name = {plan.name: plan for plan in plans}
    timeout = extproc_timeout_s(base)
    for plan in sorted(plans, key=lambda p: p.name):
        for pool in plan.pools:
            clusters[pool.name] = _cluster(plan, pool, endpoints(pool), simulate, timeout)
        if plan.name in canaries:
            if plan.model.spec.limits is not None and plan.model.spec.limits.model is not None:
                problems.append(plan.model.problem(("spec", "limits", "model"), (
                    f"{plan.name!r} is served only as the canary of another model, so it has no "
                    "model limit of its own: set limits.model on the stable model")))
            continue
        entry = _model_entry(plan, by_name, problems)
        if entry is not None:
            models[plan.name] = entry
    doc["clusters"] = clusters
    doc["models"] = models
    _merge_limits(doc, base, plans, canaries, problems)
    if problems:
        raise ConfigError(problems)
    return doc


def _check_names(base: dict[str, Any], plans: Sequence[ModelPlan], problems: list[Problem]) -> None:
    """Model and pool names taken by the base, or by two LLMModels."""
    base_clusters = set(base.get("clusters") or {})
    base_models = set(base.get("models") or {})
    base_canaries = {str(m["canary"].get("model")) for m in (base.get("models") or {}).values()
                     if isinstance(m, dict) and isinstance(m.get("canary"), dict)}
    owners: dict[str, str] = {}
    for plan in plans:
        name_at: Path = ("metadata", "name")
        if plan.name in base_models or plan.name in base_canaries:
            what = "model" if plan.name in base_models else "canary model"
            problems.append(plan.model.problem(name_at, (
                f"the routing YAML already has a {what} {plan.name!r}: rename the LLMModel or "
                "remove it from the routing YAML (onboard never overwrites it)")))
        canary = plan.model.spec.canary
        if canary is not None and canary.model in base_models | base_canaries:
            problems.append(plan.model.problem(("spec", "canary", "model"), (
                f"the routing YAML already serves {canary.model!r}: a canary model must be a "
                "name no other model or canary uses")))
        for pool in plan.pools:
            if pool.name in base_clusters:
                problems.append(plan.model.problem(name_at, (
                    f"pool {pool.name!r} of {plan.name!r} is already a cluster of the routing "
                    "YAML: rename the LLMModel or remove that cluster")))
            first = owners.setdefault(pool.name, plan.name)
            if first != plan.name:
                problems.append(plan.model.problem(name_at, (
                    f"pool {pool.name!r} of {plan.name!r} has the name of a pool of {first!r}: "
                    "rename one of the two models")))


def _cluster(plan: ModelPlan, pool: PoolPlan, addresses: list[str], simulate: bool,
             timeout_s: float) -> dict[str, Any]:
    cluster: dict[str, Any] = {"endpoints": list(addresses), "max_context": pool.context}
    if plan.kind == "chat":
        # Each pod's own vLLM load metrics pick the pod; when every pod is full a request waits
        # in extproc for at most the SLA's P99 TTFT (past it, it has missed its SLA anyway).
        # The planned --max-num-seqs is each pod's capacity until its metrics show it full.
        cluster["endpoint_picker"] = {
            "max_num_seqs": _clamp(pool.max_num_seqs, 1, 65_536),
            "flow_control": {"max_wait": sla_max_wait(plan, timeout_s)}}
    if simulate:
        sim: dict[str, Any] = {
            "kv_cache_tokens": _clamp(pool.kv_cache_tokens, 1, 1_000_000_000),
            "max_num_seqs": _clamp(pool.max_num_seqs, 1, 65_536),
            "decode_ms_per_token": round(min(max(pool.decode_ms_per_token, 0.0), 10_000.0), 4),
            "prefill_ms_per_token": round(min(max(pool.prefill_ms_per_token, 0.0), 1000.0), 4),
            "natural_stop": True}
        cluster["simulate"] = sim
    return cluster


DEFAULT_EXTPROC_TIMEOUT_S: float = ServicesSection.model_fields["extproc_timeout_s"].default
EXTPROC_MARGIN_MS = 1000
"""How much shorter than Envoy's ext_proc message timeout a request may wait in flow control."""


def extproc_timeout_s(base: dict[str, Any]) -> float:
    """``services.extproc_timeout_s`` of the routing YAML ``base`` (its default when unset; a
    wrong value is the base's own problem, which its validation names)."""
    services = base.get("services")
    value = services.get("extproc_timeout_s") if isinstance(services, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 3600:
        return float(value)
    return DEFAULT_EXTPROC_TIMEOUT_S


def sla_max_wait(plan: ModelPlan, extproc_timeout: float = DEFAULT_EXTPROC_TIMEOUT_S) -> str:
    """Flow control's ``max_wait`` for the model's pools: its SLA's P99 time to first token,
    but at most ``extproc_timeout`` (the base's ``services.extproc_timeout_s``) less
    :data:`EXTPROC_MARGIN_MS`, in whole milliseconds, at least 1.

    Why the cap: a waiting request holds extproc's answer for up to ``max_wait``, so Envoy's
    ext_proc ``message_timeout`` must be longer (``extproc_message_timeout_s`` of
    ``routing.render.envoy`` raises it to fit). That timeout lives in Envoy's bootstrap, which a
    routing reload does not change: a model added while the gateway runs with a longer wait would
    need an Envoy restart. Past the timeout's margin the request has missed a TTFT SLA that long
    anyway."""
    millis = round(plan.model.spec.sla.p99_latency_s * 1000)
    ceiling = min(int(extproc_timeout * 1000) - EXTPROC_MARGIN_MS, int(MAX_WAIT_LIMIT_S * 1000))
    return f"{_clamp(min(millis, ceiling), 1, int(MAX_WAIT_LIMIT_S * 1000))}ms"


def _clamp(value: int, low: int, high: int) -> int:
    return min(max(int(value), low), high)


def _model_entry(plan: ModelPlan, by_name: dict[str, ModelPlan],
                 problems: list[Problem]) -> dict[str, Any] | None:
    serving = sorted(plan.serving_pools, key=lambda p: p.context)
    if not serving:
        problems.append(plan.model.problem(("metadata", "name"),
                                           f"the plan of {plan.name!r} has no pool serving it"))
        return None
    entry: dict[str, Any] = {"kind": plan.kind, "clusters": [p.name for p in serving]}
    longest = serving[-1].context
    if plan.kind == "chat" and longest <= 256:
        entry["default_max_tokens"] = longest // 2  # room for a prompt (check warns otherwise)
    canary = plan.model.spec.canary
    if canary is not None:
        cluster = _canary_cluster(plan, by_name, problems)
        if cluster is not None:
            entry["canary"] = {"model": canary.model, "cluster": cluster,
                               "percent": canary.percent, "sticky": canary.sticky}
    if plan.kind == "embedding":
        entry["cache"] = {"namespace": plan.name}
    return entry


def _canary_cluster(plan: ModelPlan, by_name: dict[str, ModelPlan],
                    problems: list[Problem]) -> str | None:
    """The declared canary model's longest pool (it takes canary traffic of every length),
    else this plan's own pool serving the canary name."""
    canary = plan.model.spec.canary
    assert canary is not None
    declared = by_name.get(canary.model)
    if declared is not None:
        pools = sorted(declared.serving_pools, key=lambda p: p.context)
        if pools and pools[-1].context >= max(p.context for p in plan.serving_pools):
            return pools[-1].name
        longest = pools[-1].context if pools else 0
        problems.append(plan.model.problem(("spec", "canary", "model"), (
            f"canary {canary.model!r} serves at most {longest} tokens of context, less than "
            f"{plan.name!r} does: give it a context as long as the stable model's longest")))
        return None
    own = [p for p in plan.pools if p.serves == canary.model]
    if not own:
        problems.append(plan.model.problem(("spec", "canary", "model"), (
            f"no LLMModel declares {canary.model!r} and the plan has no canary pool for it")))
        return None
    return max(own, key=lambda p: p.context).name


def _limit_dict(limit: Limit) -> dict[str, Any]:
    return limit.model_dump(exclude_none=True)


def _same_limit(a: Any, b: Any) -> bool:
    """Equal limits, however they were written (``{requests: 10/s}`` both ways)."""
    def normal(value: Any) -> Any:
        if isinstance(value, Limit):
            return _limit_dict(value)
        try:
            return _limit_dict(Limit.model_validate(value))
        except ValueError:
            return value
    return bool(normal(a) == normal(b))


def _merge_limits(doc: dict[str, Any], base: dict[str, Any], plans: Sequence[ModelPlan],
                  canaries: dict[str, ModelPlan], problems: list[Problem]) -> None:
    """``limits.model`` → ``rate_limits.model.overrides.<name>``; ``limits.tenant`` and
    ``limits.api_key`` merged into the gateway's levels."""
    limited = [p for p in plans if p.model.spec.limits is not None]
    if not limited:
        return
    limits: dict[str, Any] = copy.deepcopy(doc.get("rate_limits") or {})
    # Where each key was set: "the routing YAML" or the LLMModel that set it first.
    set_by: dict[tuple[str, str], tuple[Any, str]] = {}
    for level in ("api_key", "tenant", "model"):
        section = limits.get(level) or {}
        if isinstance(section, dict):
            if section.get("default") is not None:
                set_by[(level, "default")] = (section["default"], "the routing YAML")
            for key, value in (section.get("overrides") or {}).items():
                set_by[(level, f"overrides.{key}")] = (value, "the routing YAML")
    key_names = {str(k.get("name")) for k in base.get("api_keys") or [] if isinstance(k, dict)}
    for plan in sorted(limited, key=lambda p: p.name):
        spec_limits = plan.model.spec.limits
        assert spec_limits is not None
        entries: list[tuple[str, str, Limit, Path]] = []
        if spec_limits.model is not None and plan.name not in canaries:
            entries.append(("model", f"overrides.{plan.name}", spec_limits.model,
                            ("spec", "limits", "model")))
        for level in ("tenant", "api_key"):
            section = getattr(spec_limits, level)
            if section is None:
                continue
            if section.default is not None:
                entries.append((level, "default", section.default, ("spec", "limits", level, "default")))
            for key, limit in section.overrides.items():
                at: Path = ("spec", "limits", level, "overrides", key)
                if level == "api_key" and key not in key_names:
                    problems.append(plan.model.problem(at, (
                        f"limits.api_key overrides {key!r}, which is not a key listed under "
                        "api_keys of the routing YAML")))
                    continue
                entries.append((level, f"overrides.{key}", limit, at))
        for level, key, limit, at in entries:
            _put(limits, set_by, plan.model, level, key, limit, at, problems)
    doc["rate_limits"] = limits


def _put(limits: dict[str, Any], set_by: dict[tuple[str, str], tuple[Any, str]],
         model: LoadedModel, level: str, key: str, limit: Limit, at: Path,
         problems: list[Problem]) -> None:
    where = f"{model.located.source}:{model.located.line_of(at)}"
    first = set_by.get((level, key))
    if first is not None:
        if not _same_limit(first[0], limit):
            problems.append(model.problem(at, (
                f"rate_limits.{level}.{key} is already set otherwise by {first[1]}: give it "
                "in one place, or the same in both")))
        return
    set_by[(level, key)] = (limit, where)
    section = limits.setdefault(level, {})
    if not isinstance(section, dict):
        return  # the base's own mistake; its validation names it
    if key == "default":
        section["default"] = _limit_dict(limit)
    else:
        section.setdefault("overrides", {})[key.removeprefix("overrides.")] = _limit_dict(limit)


def header(base_source: str, plans: Sequence[ModelPlan]) -> str:
    """``onboard``'s header of the merged routing YAML: its inputs, and to run it again."""
    sources = sorted({plan.model.located.source for plan in plans})
    return comment(f"Generated by `llm-sidecar onboard` from {quote_path(base_source)} and the "
                   f"LLMModels in {', '.join(map(quote_path, sources)) or 'no files'}:\n"
                   "edit those and run onboard again.")


def quote_path(path: str) -> str:
    """A file name for a one-line comment: a control character (a newline in a file's name)
    written as its escape, ``\\n``, so the name cannot start a line of YAML."""
    if path.isprintable():
        return path
    return repr(path)[1:-1]


def comment(text: str) -> str:
    """``text`` as YAML comment lines (``# `` before each), ending with a newline: a header that
    cannot change what the YAML under it says. Every line break Python knows ends a comment line
    (YAML ends a comment at CR or LF, which ``splitlines`` also splits on)."""
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())


def merged_yaml(base_text: str, base_source: str, plans: Sequence[ModelPlan], *,
                endpoints: Callable[[PoolPlan], list[str]], simulate: bool = False,
                header_text: str | None = None) -> str:
    """:func:`merge_routing` of the routing YAML text ``base_text`` as deterministic YAML text
    that ``llm-sidecar check`` passes (comments of the base are not kept). Raises
    :class:`ConfigError` for a base that is not valid, and for every clash.

    ``header_text``: what the comment on top says (each line becomes a ``# `` line), so a writer
    other than ``onboard`` names itself and what to edit; None: :func:`header`, ``onboard``'s."""
    located = load_yaml(base_text, base_source)
    base = located.data if located.data is not None else {}
    if not isinstance(base, dict):
        raise ConfigError([located.problem((), "the file must be a mapping with version: 1")])
    wrong = [located.problem((key,), f"{key} must be a mapping of names")
             for key in ("clusters", "models", "rate_limits")
             if base.get(key) is not None and not isinstance(base[key], dict)]
    if wrong:
        raise ConfigError(wrong)
    if base.get("clusters") and base.get("models"):
        validate(located)  # its own problems at its own lines first
    doc = merge_routing(base, plans, endpoints=endpoints, simulate=simulate)
    doc.setdefault("version", 1)
    top = header(base_source, plans) if header_text is None else comment(header_text)
    text = top + dump(doc)
    try:
        validate(load_yaml(text, base_source))
    except ConfigError as err:
        raise ConfigError([Problem(base_source, 1, f"merged with the LLMModels: {p.message}")
                           for p in err.problems]) from None
    return text
