"""The routing YAML ``onboard`` writes: the base kept, each model's pools, canary, cache and
limits added, every clash a ``FILE:LINE`` error at the LLMModel, and the result accepted by
``check`` and by Envoy."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
from typing import Any

import pytest
import yaml

from llmmodel.plans import ModelPlan, PoolPlan
from llmmodel.routing_merge import default_endpoints, merge_routing, merged_yaml
from routing.errors import ConfigError
from routing.loader import check_config, load_config, validate
from routing.render import write_all
from routing.render.envoy import extproc_message_timeout_s
from routing.yamlsrc import Located
from sidecar_runtime.process.procs import envoy_binary
from tests.harness.ci import unavailable
from tests.llmmodel.factories import model_plan

BASE = """\
version: 1
clusters:
  vllm-short: {endpoints: ["10.0.0.11:8000"], max_context: 2048}
models:
  llama-2-13b:
    clusters: [vllm-short]
    canary: {model: llama-2-13b-v2, cluster: vllm-short, percent: 5}
api_keys:
  - {name: contract-bot, sha256: "%s", tenant: legal}
rate_limits:
  tenant:
    default: {requests: 600/min}
    overrides: {legal: {requests: 1200/min}}
""" % ("a" * 64)


def base() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(BASE)
    return doc


def dns(pool: PoolPlan) -> list[str]:
    return default_endpoints(pool, "llm")


def problems(err: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [str(p) for p in err.value.problems]


def test_each_pool_becomes_a_cluster_and_the_model_lists_them_shortest_first() -> None:
    plan = model_plan(contexts=(4096, 2048, 32768))
    original = base()
    doc = merge_routing(original, [plan], endpoints=dns)
    assert original == base()  # not mutated
    assert doc["clusters"]["vllm-short"] == base()["clusters"]["vllm-short"]
    assert doc["models"]["llama-2-13b"] == base()["models"]["llama-2-13b"]
    assert doc["clusters"]["contract-review-v2-2k"] == {
        "endpoints": ["contract-review-v2-2k.llm.svc.cluster.local:8000"], "max_context": 2048,
        "endpoint_picker": {"max_num_seqs": plan.pools[0].max_num_seqs,
                            "flow_control": {"max_wait": "200ms"}}}
    assert plan.pools[0].name == "contract-review-v2-2k"
    assert doc["clusters"]["contract-review-v2-32k"]["max_context"] == 32768
    # Each pool's picker knows its pods' planned --max-num-seqs (no overfill while learning).
    for pool in plan.pools:
        assert doc["clusters"][pool.name]["endpoint_picker"]["max_num_seqs"] == pool.max_num_seqs
    assert doc["models"]["contract-review-v2"] == {
        "kind": "chat", "clusters": ["contract-review-v2-2k", "contract-review-v2-4k",
                                     "contract-review-v2-32k"]}


@pytest.mark.parametrize(("where", "edit", "message"), [
    ("model", lambda d: d["models"].update({"contract-review-v2": {"clusters": ["vllm-short"]}}),
     "the routing YAML already has a model 'contract-review-v2'"),
    ("canary", lambda d: d["models"]["llama-2-13b"]["canary"].update(model="contract-review-v2"),
     "the routing YAML already has a canary model 'contract-review-v2'"),
    ("cluster", lambda d: d["clusters"].update(
        {"contract-review-v2-4k": {"endpoints": ["10.0.0.9:8000"], "max_context": 4096}}),
     "pool 'contract-review-v2-4k' of 'contract-review-v2' is already a cluster"),
])
def test_a_name_the_base_has_is_an_error_at_the_models_name(where: str, edit: Any,
                                                             message: str) -> None:
    plan = model_plan()
    doc = base()
    edit(doc)
    with pytest.raises(ConfigError) as err:
        merge_routing(doc, [plan], endpoints=dns)
    line = plan.model.located.line_of(("metadata", "name"))
    assert len(err.value.problems) == 1, where
    assert problems(err)[0].startswith(f"models/x.yaml:{line}: {message}")


def test_two_models_whose_pools_share_a_name_are_refused() -> None:
    first = model_plan("a-b", contexts=(2048,))
    second = model_plan("a", contexts=(2048,), source="models/y.yaml")
    renamed = ModelPlan(second.model, (dataclasses.replace(second.pools[0], name="a-b-2k"),))
    with pytest.raises(ConfigError, match=r"models/y.yaml:\d+: pool 'a-b-2k' of 'a' has the "
                                          r"name of a pool of 'a-b'"):
        merge_routing(base(), [first, renamed], endpoints=dns)


def test_a_canary_pool_of_the_plan_serves_the_canary() -> None:
    plan = model_plan(canary={"model": "contract-review-v3", "percent": 5, "sticky": "tenant"})
    doc = merge_routing(base(), [plan], endpoints=dns)
    entry = doc["models"]["contract-review-v2"]
    assert entry["clusters"] == ["contract-review-v2-2k", "contract-review-v2-4k"]
    assert entry["canary"] == {"model": "contract-review-v3", "cluster": "contract-review-v2-canary",
                               "percent": 5.0, "sticky": "tenant"}
    assert doc["clusters"]["contract-review-v2-canary"]["max_context"] == 4096
    assert "contract-review-v3" not in doc["models"]


def test_a_declared_canary_model_lends_its_longest_pool_and_gets_no_model_entry(
        tmp_path: pathlib.Path) -> None:
    stable = model_plan(canary={"model": "contract-review-v3", "percent": 10}, canary_pool=False)
    canary = model_plan("contract-review-v3", contexts=(2048, 8192), source="models/v3.yaml",
                        canary_of="contract-review-v2")
    text = merged_yaml(BASE, "routing.yaml", [stable, canary], endpoints=dns)
    doc = yaml.safe_load(text)
    assert doc["models"]["contract-review-v2"]["canary"]["cluster"] == "contract-review-v3-8k"
    assert "contract-review-v3" not in doc["models"]  # a canary model that is a model overlaps
    assert {"contract-review-v3-2k", "contract-review-v3-8k"} <= set(doc["clusters"])
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    check_config(str(path))


def test_a_declared_canary_shorter_than_the_stable_model_is_refused() -> None:
    stable = model_plan(contexts=(2048, 8192), canary={"model": "v3", "percent": 10},
                        canary_pool=False)
    canary = model_plan("v3", contexts=(2048,), source="models/v3.yaml", canary_of="contract-review-v2")
    with pytest.raises(ConfigError) as err:
        merge_routing(base(), [stable, canary], endpoints=dns)
    line = stable.model.located.line_of(("spec", "canary", "model"))
    assert problems(err) == [f"models/x.yaml:{line}: canary 'v3' serves at most 2048 tokens of "
                             "context, less than 'contract-review-v2' does: give it a context as "
                             "long as the stable model's longest"]


def test_an_embedding_model_gets_its_cache_namespace_and_no_picker() -> None:
    plan = model_plan("bge-m3", contexts=(8192,), kind="embedding")
    doc = merge_routing(base(), [plan], endpoints=dns)
    assert doc["models"]["bge-m3"] == {"kind": "embedding", "clusters": ["bge-m3-8k"],
                                       "cache": {"namespace": "bge-m3"}}
    assert "endpoint_picker" not in doc["clusters"]["bge-m3-8k"]


def test_simulate_sizes_the_simulated_pods_from_the_plan() -> None:
    plan = model_plan(contexts=(2048,))
    pool = plan.pools[0]
    doc = merge_routing(base(), [plan], endpoints=lambda p: ["127.0.0.1:18001"], simulate=True)
    cluster = doc["clusters"]["contract-review-v2-2k"]
    assert cluster["endpoints"] == ["127.0.0.1:18001"]
    assert cluster["simulate"] == {"kv_cache_tokens": pool.kv_cache_tokens,
                                   "max_num_seqs": pool.max_num_seqs,
                                   "decode_ms_per_token": pool.decode_ms_per_token,
                                   "prefill_ms_per_token": pool.prefill_ms_per_token,
                                   "natural_stop": True}
    assert "simulate" not in merge_routing(base(), [plan], endpoints=dns)["clusters"][pool.name]


def test_limits_go_to_the_model_level_and_merge_into_tenant_and_api_key() -> None:
    plan = model_plan(limits={"model": {"requests": "40/s"},
                              "tenant": {"overrides": {"research": {"tokens": "2M/min"},
                                                       "legal": {"requests": "1200/min"}}},
                              "api_key": {"default": {"requests": "10/s"},
                                          "overrides": {"contract-bot": {"requests": "50/s"}}}})
    doc = merge_routing(base(), [plan], endpoints=dns)
    limits = doc["rate_limits"]
    assert limits["model"] == {"overrides": {"contract-review-v2": {"requests": "40/s"}}}
    # legal was set the same in both: one entry
    assert limits["tenant"] == {"default": {"requests": "600/min"},
                                "overrides": {"legal": {"requests": "1200/min"},
                                              "research": {"tokens": "2M/min"}}}
    assert limits["api_key"] == {"default": {"requests": "10/s"},
                                 "overrides": {"contract-bot": {"requests": "50/s"}}}


def test_a_tenant_default_fills_a_level_the_base_does_not_set() -> None:
    doc = base()
    del doc["rate_limits"]["tenant"]["default"]
    plan = model_plan(limits={"tenant": {"default": {"requests": "5/s"}}})
    merged = merge_routing(doc, [plan], endpoints=dns)
    assert merged["rate_limits"]["tenant"]["default"] == {"requests": "5/s"}


@pytest.mark.parametrize(("tenant", "at", "key"), [
    ({"overrides": {"legal": {"requests": "9/s"}}}, ("overrides", "legal"), "overrides.legal"),
    ({"default": {"requests": "1/s"}}, ("default",), "default"),
])
def test_a_limit_the_base_sets_otherwise_is_an_error_at_the_models_line(
        tenant: dict[str, Any], at: tuple[str, ...], key: str) -> None:
    plan = model_plan(limits={"tenant": tenant})
    with pytest.raises(ConfigError) as err:
        merge_routing(base(), [plan], endpoints=dns)
    line = plan.model.located.line_of(("spec", "limits", "tenant", *at))
    assert problems(err) == [f"models/x.yaml:{line}: rate_limits.tenant.{key} is "
                             "already set otherwise by the routing YAML: give it in one place, "
                             "or the same in both"]


def test_two_models_setting_one_limit_differently_are_refused() -> None:
    first = model_plan("a", limits={"tenant": {"overrides": {"ops": {"requests": "1/s"}}}})
    second = model_plan("b", limits={"tenant": {"overrides": {"ops": {"requests": "2/s"}}}},
                        source="models/b.yaml")
    with pytest.raises(ConfigError) as err:
        merge_routing(base(), [first, second], endpoints=dns)
    first_line = first.model.located.line_of(("spec", "limits", "tenant", "overrides", "ops"))
    line = second.model.located.line_of(("spec", "limits", "tenant", "overrides", "ops"))
    assert problems(err) == [f"models/b.yaml:{line}: rate_limits.tenant.overrides.ops is already "
                             f"set otherwise by models/x.yaml:{first_line}: give it in one place, "
                             "or the same in both"]
    same = model_plan("b", limits={"tenant": {"overrides": {"ops": {"requests": "1/s"}}}})
    merged = merge_routing(base(), [first, same], endpoints=dns)
    assert merged["rate_limits"]["tenant"]["overrides"]["ops"] == {"requests": "1/s"}


def test_an_api_key_limit_for_an_unlisted_key_is_refused() -> None:
    plan = model_plan(limits={"api_key": {"overrides": {"nobody": {"requests": "1/s"}}}})
    with pytest.raises(ConfigError, match=r"limits.api_key overrides 'nobody', which is not a "
                                          "key listed under api_keys"):
        merge_routing(base(), [plan], endpoints=dns)


def test_merged_yaml_is_deterministic_and_says_where_it_came_from(tmp_path: pathlib.Path) -> None:
    plans = [model_plan("b-model", canary={"model": "b-next", "percent": 5}),
             model_plan("a-model", contexts=(2048,), source="models/a.yaml"),
             model_plan("embed", contexts=(8192,), kind="embedding", source="models/e.yaml")]
    text = merged_yaml(BASE, "routing.yaml", plans, endpoints=dns)
    assert text == merged_yaml(BASE, "routing.yaml", list(reversed(plans)), endpoints=dns)
    assert text.startswith("# Generated by `llm-sidecar onboard` from routing.yaml and the "
                           "LLMModels in models/a.yaml, models/e.yaml, models/x.yaml")
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    alone = tmp_path / "base.yaml"
    alone.write_text(BASE)
    # no warning of its own: only the base's (open mode with api_keys and tenant limits)
    assert [p.message for p in check_config(str(path))] == [
        p.message for p in check_config(str(alone))]
    config = load_config(str(path))
    assert config.models["b-model"].canary is not None
    assert config.clusters["a-model-2k"].endpoint_picker is not None


def test_another_writer_names_itself_in_the_header_and_the_yaml_is_the_same() -> None:
    """The operator's ConfigMap must not tell a reader to run onboard: the header is the
    writer's, every line a comment, and the document under it unchanged."""
    plans = [model_plan("a-model", contexts=(2048,), source="models/a.yaml")]
    onboard = merged_yaml(BASE, "routing.yaml", plans, endpoints=dns)
    text = merged_yaml(BASE, "routing.yaml", plans, endpoints=dns,
                       header_text="Written by `llm-sidecar operator`:\nedit the LLMModels, not this")
    assert text.startswith("# Written by `llm-sidecar operator`:\n# edit the LLMModels, not this\n")
    assert "onboard" not in text
    assert yaml.safe_load(text) == yaml.safe_load(onboard)


def test_a_base_with_errors_reports_them_at_its_own_lines() -> None:
    with pytest.raises(ConfigError, match=r"^routing.yaml:6: model 'llama-2-13b' names unknown "
                                          "cluster 'nope'"):
        merged_yaml(BASE.replace("clusters: [vllm-short]", "clusters: [nope]"), "routing.yaml",
                    [model_plan()], endpoints=dns)


def test_a_base_whose_clusters_are_not_a_mapping_is_refused_at_its_line() -> None:
    with pytest.raises(ConfigError) as err:
        merged_yaml("version: 1\nclusters: [a, b]\n", "routing.yaml", [model_plan()],
                    endpoints=dns)
    assert problems(err) == ["routing.yaml:2: clusters must be a mapping of names"]


def test_a_base_without_models_of_its_own_is_completed() -> None:
    text = merged_yaml("version: 1\n", "routing.yaml", [model_plan()], endpoints=dns)
    assert list(yaml.safe_load(text)["models"]) == ["contract-review-v2"]


def test_envoy_accepts_what_render_writes_from_the_merged_yaml(tmp_path: pathlib.Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    plans = [model_plan(canary={"model": "contract-review-v3", "percent": 5},
                        limits={"model": {"requests": "40/s"}}),
             model_plan("bge-m3", contexts=(8192,), kind="embedding", source="models/e.yaml")]
    path = tmp_path / "routing.yaml"
    path.write_text(merged_yaml(BASE, "routing.yaml", plans, endpoints=dns))
    written = write_all(load_config(str(path)), str(tmp_path / "out"))
    bootstrap = next(p for p in written if p.endswith("envoy.yaml"))
    result = subprocess.run([envoy, "--mode", "validate", "-c", bootstrap],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    clusters = {c["name"] for c in yaml.safe_load(pathlib.Path(bootstrap).read_text())
                ["static_resources"]["clusters"]}
    assert {"contract-review-v2-2k", "contract-review-v2-canary", "bge-m3-8k"} <= clusters


@pytest.mark.parametrize(("p99", "extproc_timeout", "max_wait"), [
    ("200ms", None, "200ms"), ("1.5s", None, "1500ms"), ("0.0004s", None, "1ms"),
    ("5s", None, "4000ms"), ("5s", 10, "5000ms"), ("10m", 60, "59000ms")])
def test_a_full_pool_holds_a_request_for_at_most_the_slas_ttft(p99: str, extproc_timeout: float | None,
                                                               max_wait: str) -> None:
    """Flow control's max_wait is the SLA's P99 time to first token (a request still waiting
    then has missed it), at least 1 ms and at most 1 s under the base's extproc timeout (5 s by
    default), so Envoy's ext_proc message timeout, set at start-up, never has to grow."""
    plan = model_plan(sla={"p99Latency": p99, "availability": "99.9%"})
    given = base()
    if extproc_timeout is not None:
        given["services"] = {"extproc_timeout_s": extproc_timeout}
    doc = merge_routing(given, [plan], endpoints=dns)
    for pool in plan.pools:
        assert doc["clusters"][pool.name]["endpoint_picker"]["flow_control"] == {
            "max_wait": max_wait}
    config = validate(Located("routing.yaml", doc))
    cluster = config.clusters[plan.pools[0].name]
    assert cluster.endpoint_picker is not None and cluster.endpoint_picker.flow_control is not None
    assert cluster.endpoint_picker.flow_control.max_wait_s == pytest.approx(
        int(max_wait.removesuffix("ms")) / 1000)
    # Envoy's ext_proc message timeout stays the configured one: no restart to take the model.
    assert extproc_message_timeout_s(config) == pytest.approx(extproc_timeout or 5.0)


def test_a_declared_model_named_as_canary_without_canary_of_keeps_its_entry_and_is_an_error() -> None:
    stable = model_plan(canary={"model": "victim", "percent": 1}, canary_pool=False)
    victim = model_plan("victim", source="models/victim.yaml")
    with pytest.raises(ConfigError) as err:
        merge_routing(base(), [stable, victim], endpoints=dns)
    line = stable.model.located.line_of(("spec", "canary", "model"))
    assert problems(err) == [f"models/x.yaml:{line}: 'victim' is served as a model of its own; to make "
                             "it this model's canary, set canaryOf: contract-review-v2 in its LLMModel"]


def test_a_file_name_with_a_newline_cannot_add_yaml_to_the_header() -> None:
    source = "models/a\nauth: {required: false}\n#.yaml"
    plan = model_plan(source=source)
    text = merged_yaml(BASE, "routing\nversion: 2.yaml", [plan], endpoints=dns)
    header = text.split("version: 1\n", 1)[0]
    assert header.splitlines() == [
        "# Generated by `llm-sidecar onboard` from routing\\nversion: 2.yaml and the LLMModels in "
        "models/a\\nauth: {required: false}\\n#.yaml:",
        "# edit those and run onboard again."]
    assert "auth" not in yaml.safe_load(text)
