"""The routing YAML's rate_limits → descriptors (loaded by the ratelimit service) and actions."""

from __future__ import annotations

import hashlib
from typing import Any

from ratelimit.loader import load_document
from routing.compiled import listed_key_id
from routing.loader import validate
from routing.ratelimits import descriptors, route_rate_limits
from routing.yamlsrc import Located
from tests.extproc.helpers import BASE

SHA = hashlib.sha256(b"sk-bot").hexdigest()


def config(rate_limits: dict[str, Any] | None) -> Any:
    doc = {**BASE, "api_keys": [{"name": "bot", "sha256": SHA, "tenant": "legal"}],
           "rate_limits": rate_limits}
    return validate(Located("t.yaml", doc, {}))


def kind_and_header(actions: list[dict[str, Any]]) -> tuple[str, str]:
    """The ``kind`` entry and the level's header of one rate limit's actions."""
    [kind] = [a["generic_key"]["descriptor_value"] for a in actions
              if a.get("generic_key", {}).get("descriptor_key") == "kind"]
    [header] = [a["request_headers"]["header_name"] for a in actions if "request_headers" in a]
    return kind, header


def branch(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return next(d["descriptors"] for d in doc["descriptors"] if d["value"] == kind)


def test_override_inherits_unset_fields_and_names_keys_by_id() -> None:
    doc = descriptors(config({"api_key": {
        "default": {"requests": "10/s", "burst": 20, "tokens": "100k/min"},
        "overrides": {"bot": {"requests": "50/s"}}}}))
    requests = branch(doc, "requests")
    assert requests[0] == {"key": "api_key", "rate_limit": {
        "name": "api_key:default:requests", "requests_per_unit": 10, "unit": "second",
        "burst": 20}}
    assert requests[1]["value"] == listed_key_id(SHA)
    assert requests[1]["rate_limit"] == {"name": "api_key:bot:requests",
                                         "requests_per_unit": 50, "unit": "second"}
    tokens = branch(doc, "tokens")
    assert tokens[1]["rate_limit"] == {"name": "api_key:bot:tokens", "requests_per_unit": 100000,
                                       "unit": "minute"}


def test_multi_unit_windows() -> None:
    doc = descriptors(config({"tenant": {"default": {"requests": "50/5m", "tokens": "1M/2h"}}}))
    assert branch(doc, "requests")[0]["rate_limit"]["unit_multiplier"] == 5
    assert branch(doc, "tokens")[0]["rate_limit"] == {
        "name": "tenant:default:tokens", "requests_per_unit": 1_000_000, "unit": "hour",
        "unit_multiplier": 2}


def test_descriptors_load_in_the_ratelimit_service() -> None:
    doc = descriptors(config({"api_key": {"default": {"requests": "10/s", "tokens": "1k/min"}},
                              "model": {"overrides": {"llama-2-13b": {"requests": "40/s"}}},
                              "on_backend_error": "deny"}))
    loaded = load_document(doc, "t.yaml")
    assert list(loaded.domains) == ["llm-sidecar"]


def test_actions_reserve_at_start_and_settle_at_stream_end() -> None:
    actions = route_rate_limits(config({"tenant": {"default": {"requests": "1/s",
                                                               "tokens": "1k/min"}}}))
    assert len(actions) == 3
    assert "hits_addend" not in actions[0]
    assert actions[1]["hits_addend"] == {
        "format": "%DYNAMIC_METADATA(llm_sidecar:llm_reservation)%"}
    lease = actions[1]["actions"][2]["metadata"]
    assert lease["descriptor_key"] == "llm_sidecar.lease" and lease["skip_if_absent"] is True
    done = actions[2]
    assert done["apply_on_stream_done"] is True
    # No usage known (client gone, stream cut): Envoy builds no descriptor, the reservation stands.
    used = done["actions"][3]["metadata"]
    assert used["descriptor_key"] == "llm_sidecar.used" and "skip_if_absent" not in used
    assert used["metadata_key"]["path"] == [{"key": "llm_tokens"}]
    headers = [a["actions"][1]["request_headers"]["header_name"] for a in actions]
    assert headers == ["x-llm-tenant"] * 3


def test_concurrent_and_shadow_limits() -> None:
    cfg = config({"api_key": {"default": {"concurrent": 4},
                              "overrides": {"bot": {"requests": "1/s", "shadow": True}}}})
    doc = descriptors(cfg)
    conc = branch(doc, "concurrent")
    assert conc[0] == {"key": "api_key", "rate_limit": {"name": "api_key:default:concurrent",
                                                        "concurrent": 4}}
    # The override inherits the cap and turns both of its limits into shadow limits.
    assert conc[1]["shadow_mode"] is True and conc[1]["rate_limit"]["concurrent"] == 4
    assert branch(doc, "requests")[0]["shadow_mode"] is True
    loaded = load_document(doc, "t.yaml").domains["llm-sidecar"]
    limit = loaded.match((("kind", "concurrent"), ("api_key", "anyone")))
    assert limit is not None and limit.concurrent == 4 and not limit.shadow_mode
    actions = route_rate_limits(cfg)
    kinds = [(kind_and_header(a["actions"])[0], a.get("apply_on_stream_done", False))
             for a in actions]
    assert kinds == [("requests", False), ("concurrent", False), ("concurrent", True)]
    assert actions[2]["actions"][-1] == {"generic_key": {"descriptor_key": "llm_sidecar.release",
                                                         "descriptor_value": "1"}}


def test_the_bootstrap_carries_every_level_so_a_reloaded_limit_binds_at_once() -> None:
    """Envoy reads its bootstrap once: with ``rate_limits:`` at all, every (kind, level) is
    there, so a limit a reload adds at a level it had none at is enforced without a restart."""
    cfg = config({"tenant": {"default": {"requests": "1/s"}}})
    actions = route_rate_limits(cfg, every_level=True)
    shape = [(*kind_and_header(a["actions"]), a.get("apply_on_stream_done", False))
             for a in actions]
    levels = ["x-llm-key-id", "x-llm-tenant", "x-llm-model"]
    assert shape == ([("requests", h, False) for h in levels]
                     + [(k, h, done) for k in ("tokens", "concurrent") for h in levels
                        for done in (False, True)])
    # A slot is taken (and a stream-done call made to free it) only for a request extproc
    # marks: one a cap of the running config applies to.
    # The mark is the first action: Envoy stops there for every other request.
    for rate_limit in actions:
        if kind_and_header(rate_limit["actions"])[0] == "concurrent":
            cap = rate_limit["actions"][0]["metadata"]
            assert cap["metadata_key"]["path"] == [{"key": "llm_cap"}]
            assert "skip_if_absent" not in cap
    assert route_rate_limits(config(None), every_level=True) == []
