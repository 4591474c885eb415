"""Strict loading of envoyproxy/ratelimit descriptor files into a :class:`RateLimitConfig`.

The format is envoyproxy/ratelimit's (``domain``, nested ``descriptors`` with ``key``,
optional ``value`` (``prefix*`` wildcards), ``rate_limit {unit, requests_per_unit, unlimited,
name, replaces}``, ``shadow_mode``, ``detailed_metric``) plus these extensions:

* ``rate_limit.burst``: bucket capacity (default ``requests_per_unit``);
* ``rate_limit.unit: 5m`` (``30s``, ``5m``, ``12h``, ``7d``, ``2w``) or
  ``rate_limit.unit_multiplier: 5`` with a plain unit: a window of several units;
* ``rate_limit.debt: true``: an LLM-token bucket charged after the fact (see ``bucket.py``);
* ``rate_limit.concurrent: N`` (instead of ``unit``/``requests_per_unit``): at most N requests
  in flight, each holding a slot under its lease until the stream-done call releases it;
* top-level ``on_backend_error: allow|deny`` (default ``allow``).

Every problem is reported, each at its own line, as one :class:`ConfigError` (``FILE:LINE:
message`` per problem, the lines ``llm-sidecar check`` prints). A routing YAML (a file with a
top-level ``version:``) is validated by ``routing.loader`` and compiled by
:func:`ratelimit.from_routing.compile_rate_limits`, from the one parse of the file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path as FsPath
from types import MappingProxyType
from typing import Any

from ratelimit.descriptors import DomainConfig, RateLimitConfig
from ratelimit.errors import ConfigError, Problem
from ratelimit.from_descriptors import compile_domain
from ratelimit.from_routing import compile_rate_limits
from routing.loader import validate
from routing.schema import RoutingConfig
from routing.yamlsrc import DESCRIPTORS, ROUTING, Located, Path, load_yaml, read_config_text

__all__ = ["compile_domain", "is_routing_yaml", "load_document", "load_path", "load_text",
           "read_config", "routing_config"]

YAML_SUFFIXES = (".yaml", ".yml")
_ROUTING_TEXT = re.compile(r"""^["']?version["']?[ \t]*:""", re.MULTILINE)
"""A top-level ``version:`` line: read before parsing, so even a routing YAML that does not
parse is reported in the routing YAML's words, as ``llm-sidecar check`` reports it."""


def load_path(path: str | FsPath) -> RateLimitConfig:
    """Load a descriptor file, a routing YAML, or a directory of YAML files (one domain each;
    hidden entries such as Kubernetes' ``..data`` are skipped, symlinks are followed). The
    problems of every file are reported together."""
    root = FsPath(path)
    if root.is_dir():
        files = sorted(
            entry
            for entry in root.iterdir()
            if not entry.name.startswith(".") and entry.name.endswith(YAML_SUFFIXES) and entry.is_file()
        )
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError.at(str(root), 1, "no such file or directory")
    domains: list[DomainConfig] = []
    problems: list[Problem] = []
    for file in files:
        try:
            domains.append(_load_file(file))
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return _merge(domains)


def load_document(
    doc: Mapping[str, Any], source: str, lines: Mapping[Path, int] | None = None
) -> RateLimitConfig:
    """Load one descriptor document given as a dict (e.g. the one ``llm-sidecar render``
    writes). ``source`` names it in errors; ``lines`` optionally maps paths such as
    ``("descriptors", 0, "rate_limit", "unit")`` to lines of the file it came from."""
    return _merge([compile_domain(Located(source, doc, dict(lines or {})))])


def load_text(text: str, source: str) -> RateLimitConfig:
    """Load one descriptor document from YAML text."""
    return _merge([compile_domain(load_yaml(text, source, DESCRIPTORS))])


def is_routing_yaml(doc: Located) -> bool:
    return isinstance(doc.data, dict) and "version" in doc.data


def read_config(file: FsPath) -> Located:
    """Read and parse one file, worded as its format words YAML problems."""
    source = str(file)
    text = read_config_text(source)
    return load_yaml(text, source, ROUTING if _ROUTING_TEXT.search(text) else DESCRIPTORS)


def routing_config(doc: Located) -> RoutingConfig | None:
    """The validated routing YAML when ``doc`` is one (else None); raises :class:`ConfigError`
    with every problem of it, as ``llm-sidecar check`` does."""
    return validate(doc) if is_routing_yaml(doc) else None


def _load_file(file: FsPath) -> DomainConfig:
    doc = read_config(file)
    config = routing_config(doc)
    if config is not None:
        return compile_rate_limits(config, doc.source)
    return compile_domain(doc)


def _merge(domains: list[DomainConfig]) -> RateLimitConfig:
    seen: dict[str, DomainConfig] = {}
    problems: list[Problem] = []
    for domain in domains:
        first = seen.get(domain.name)
        if first is not None:
            problems.append(Problem(
                domain.source,
                domain.line,
                f"duplicate domain '{domain.name}' (first in {first.source}:{first.line})",
            ))
            continue
        seen[domain.name] = domain
    if problems:
        raise ConfigError(problems)
    return RateLimitConfig(MappingProxyType(seen), tuple(domain.source for domain in domains))
