"""The output budget written into a generation request that sets none (docs: Rate limits).

A request's token reservation assumes ``default_max_tokens`` of output when it sets no
``max_tokens``, but vLLM gives such a chat request the rest of its context window. When the
usage is never known (the client hangs up before the usage chunk) the reservation stands, so a
client that set no budget could receive thousands of tokens and pay for 256. So when an
enforcing token bucket charges the request, extproc writes the budget it reserved for into the
body as ``max_tokens``: the reservation is then a true bound on what vLLM generates.

Pure: which buckets charge a request is read off the same limit entries the rate-limit service
and the rendered descriptors are built from (:func:`routing.ratelimits.limit_entries`), for the
level values of the ``x-llm-*`` headers Envoy rate-limits the request on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.bodies import Api
from extproc.hit_limits import limit_applies
from routing.schema import RoutingConfig


def charged_for_tokens(config: RoutingConfig, headers: Mapping[str, str]) -> bool:
    """Does an enforcing token limit charge a request routed with ``headers``?"""
    return limit_applies(config, headers, "tokens", enforcing=True)


VLLM_COMPLETIONS_DEFAULT = 16
"""vLLM's ``max_tokens`` for a completions request that has none (OpenAI's legacy default)."""


def budget_unset(api: Api, doc: Mapping[str, Any], budget: int = VLLM_COMPLETIONS_DEFAULT) -> bool:
    """Would vLLM give this request more output than ``budget`` of its own accord?

    Chat: vLLM reads ``max_completion_tokens or max_tokens`` and, when that is None, gives the
    rest of the context window. Completions: an explicit ``null`` leaves the window; an absent
    ``max_tokens`` is vLLM's 16, more than a ``budget`` below 16 only. A 0 or a negative budget
    is vLLM's 400, and is left for it to answer.
    """
    if api == "chat":
        return (doc.get("max_completion_tokens") or doc.get("max_tokens")) is None
    if "max_tokens" in doc:
        return doc["max_tokens"] is None
    return budget < VLLM_COMPLETIONS_DEFAULT


def upstream_max_tokens(config: RoutingConfig, api: Api, doc: Mapping[str, Any],
                        default_max_tokens: int, route: Mapping[str, str]) -> int | None:
    """The ``max_tokens`` to write into the request sent upstream (``route``: the routing
    headers extproc sets on it), or None to leave its body's budget as the client set it.

    Written when an enforcing token limit charges the request (its reservation assumed it), and
    when extproc gives vLLM the request's priority (its tier assumed it: without the budget, a
    request that set none would get vLLM's best place and the rest of the window)."""
    if default_max_tokens < 1 or not budget_unset(api, doc, default_max_tokens):
        return None
    if config.priority.inject or charged_for_tokens(config, route):
        return default_max_tokens
    return None


__all__ = ["VLLM_COMPLETIONS_DEFAULT", "budget_unset", "charged_for_tokens",
           "upstream_max_tokens"]
