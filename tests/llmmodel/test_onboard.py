"""``llm-sidecar onboard``: the files it writes build with kustomize and pass ``check``, the same
input writes the same bytes, bad input is one clear line, and the real planner's output for the
shipped examples goes through all of it."""

from __future__ import annotations

import argparse
import pathlib
import subprocess

import pytest
from kubernetes_validate import latest_version, validate

from llmmodel import onboard as onboard_module
from llmmodel.onboard import onboard
from llmmodel.onboard_cli import add_onboard_arguments, onboard_command
from llmmodel.plans import ModelPlan
from routing.loader import check_config, load_config
from routing.render import write_all
from sidecar_runtime.process.procs import envoy_binary
from tests.harness.ci import unavailable
from tests.harness.kubectl import kustomize
from tests.llmmodel.factories import model_plan

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "models"
BASE = "version: 1\nclusters:\n  other: {endpoints: ['10.0.0.1:8000'], max_context: 2048}\n" \
       "models:\n  other: {clusters: [other]}\n"


@pytest.fixture
def hand_plans(monkeypatch: pytest.MonkeyPatch) -> list[ModelPlan]:
    """Plans built by hand, given to onboard in place of the planner's."""
    plans = [model_plan(canary={"model": "contract-review-v3", "percent": 5},
                        limits={"model": {"requests": "40/s"}}),
             model_plan("bge-m3", contexts=(8192,), kind="embedding", source="models/e.yaml")]
    monkeypatch.setattr(onboard_module, "plan_files", lambda paths, gpus: plans)
    return plans


def routing_file(tmp_path: pathlib.Path, text: str = BASE) -> str:
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    return str(path)


def envoy_validate(path: str) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError:
        unavailable("envoy")
    result = subprocess.run([envoy, "--mode", "validate", "-c", path], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_onboard_writes_routing_k8s_and_plan(tmp_path: pathlib.Path,
                                             hand_plans: list[ModelPlan]) -> None:
    out = tmp_path / "out"
    written = onboard(["models"], routing_file(tmp_path), str(out), namespace="llm")
    assert sorted(written) == sorted(str(out / p) for p in (
        "routing.yaml", "plan.md", "k8s/crd.yaml", "k8s/kustomization.yaml",
        "k8s/bge-m3.yaml", "k8s/contract-review-v2.yaml"))
    check_config(str(out / "routing.yaml"))
    config = load_config(str(out / "routing.yaml"))
    assert config.clusters["contract-review-v2-2k"].endpoints == [
        "contract-review-v2-2k.llm.svc.cluster.local:8000"]
    assert "other" in config.models
    built = kustomize(out / "k8s")
    kinds = sorted({d["kind"] for d in built})
    assert kinds == ["CustomResourceDefinition", "Deployment", "InferencePool", "NetworkPolicy",
                     "PodMonitor", "PrometheusRule", "Service"]
    pools = {p.name for plan in hand_plans for p in plan.pools}
    assert {d["metadata"]["name"] for d in built if d["kind"] == "Deployment"} == pools
    for doc in built:
        if doc["kind"] in ("Deployment", "Service", "NetworkPolicy", "CustomResourceDefinition"):
            validate(doc, latest_version(), strict=True)
    plan_md = (out / "plan.md").read_text()
    for pool in hand_plans[0].pools:
        assert f"### `{pool.name}`" in plan_md
        assert f"{pool.kv_cache_tokens:,} tokens" in plan_md
        for flag, reason in pool.reasons.items():
            assert f"| `{flag}` |" in plan_md and reason in plan_md


def test_the_same_input_writes_the_same_bytes(tmp_path: pathlib.Path,
                                              hand_plans: list[ModelPlan]) -> None:
    routing = routing_file(tmp_path)
    first = onboard(["models"], routing, str(tmp_path / "a"))
    before = {p: pathlib.Path(p).read_bytes() for p in first}
    again = onboard(["models"], routing, str(tmp_path / "a"))
    assert again == first
    assert {p: pathlib.Path(p).read_bytes() for p in again} == before
    other = onboard(["models"], routing, str(tmp_path / "b"))
    assert [pathlib.Path(p).read_bytes() for p in other] == list(before.values())
    assert not list((tmp_path / "a").rglob("*.tmp"))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llm-sidecar onboard")
    add_onboard_arguments(parser)
    return parser.parse_args(argv)


def test_the_command_prints_the_paths(tmp_path: pathlib.Path, hand_plans: list[ModelPlan],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["m.yaml", "--config", routing_file(tmp_path), "--out", str(tmp_path / "o"),
                  "--namespace", "llm"])
    assert onboard_command(args) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "o" / "routing.yaml") in printed and len(printed) == 6


def test_an_out_that_is_a_file_is_a_clear_error(tmp_path: pathlib.Path, hand_plans: list[ModelPlan],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("x")
    args = parse(["m.yaml", "--config", routing_file(tmp_path), "--out", str(taken)])
    assert onboard_command(args) == 1
    assert capsys.readouterr().err == (f"llm-sidecar onboard: --out {taken}: not a folder: give a "
                                       "folder (it is created when missing)\n")
    assert taken.read_text() == "x"


def test_a_clash_is_one_line_per_problem_and_nothing_is_written(
        tmp_path: pathlib.Path, hand_plans: list[ModelPlan],
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ("version: 1\nclusters:\n  bge-m3-8k: {endpoints: ['10.0.0.1:8000'], max_context: 8192}\n"
            "models:\n  bge-m3: {kind: embedding, clusters: [bge-m3-8k]}\n")
    args = parse(["m.yaml", "--config", routing_file(tmp_path, base), "--out",
                  str(tmp_path / "o")])
    assert onboard_command(args) == 1
    line = hand_plans[1].model.located.line_of(("metadata", "name"))
    assert capsys.readouterr().err.splitlines() == [
        f"models/e.yaml:{line}: the routing YAML already has a model 'bge-m3': rename the LLMModel "
        "or remove it from the routing YAML (onboard never overwrites it)",
        f"models/e.yaml:{line}: pool 'bge-m3-8k' of 'bge-m3' is already a cluster of the routing "
        "YAML: rename the LLMModel or remove that cluster"]
    assert not (tmp_path / "o").exists()


def test_a_missing_routing_file_is_a_config_error(tmp_path: pathlib.Path,
                                                  hand_plans: list[ModelPlan],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert onboard_command(parse(["m.yaml", "--config", missing, "--out", str(tmp_path)])) == 1
    assert capsys.readouterr().err.startswith(f"{missing}:1: cannot read the file")


def test_a_bad_namespace_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["m.yaml", "--config", "r.yaml", "--out", "o", "--namespace", "LLM_NS"])
    assert exit_.value.code == 2
    assert "'LLM_NS' is not a Kubernetes namespace" in capsys.readouterr().err


def test_a_bad_model_file_is_file_line_through_the_real_planner(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: llm-sidecar.dev/v1alpha1\nkind: LLMModel\nmetadata: {name: m}\n"
                   "spec:\n  modelPath: hf://a/b\n  gpuRequest: lots\n  sla: {p99Latency: 1s}\n")
    args = parse([str(bad), "--config", routing_file(tmp_path), "--out", str(tmp_path / "o")])
    assert onboard_command(args) == 1
    assert capsys.readouterr().err.startswith(f"{bad}:6: ")


def test_the_shipped_examples_onboard_through_the_real_planner(tmp_path: pathlib.Path) -> None:
    """End to end: examples/models, the built-in GPU catalog and the real planner."""
    from llmmodel.catalog import load_gpus
    from llmmodel.planner import plan_models
    from llmmodel.spec import load_models

    out = tmp_path / "out"
    written = onboard([str(EXAMPLES)], routing_file(tmp_path), str(out), namespace="llm")
    assert len(written) == 4 + len(list(EXAMPLES.glob("*.yaml")))
    assert check_config(str(out / "routing.yaml")) == []
    plans = plan_models(load_models([str(EXAMPLES)]), load_gpus(None))
    config = load_config(str(out / "routing.yaml"))
    built = kustomize(out / "k8s")
    deployments = {d["metadata"]["name"]: d for d in built if d["kind"] == "Deployment"}
    hpas = {d["metadata"]["name"]: d for d in built if d["kind"] == "HorizontalPodAutoscaler"}
    assert hpas  # contract-review's replicas {min: 1, max: 4}
    for plan in plans:
        assert config.models[plan.name].clusters == [p.name for p in plan.serving_pools]
        replicas = plan.model.spec.replicas
        for pool in plan.serving_pools:
            spec = deployments[pool.name]["spec"]
            if replicas.max > replicas.min:
                hpa = hpas.pop(pool.name)
                assert hpa["metadata"]["namespace"] == "llm"
                assert hpa["spec"]["scaleTargetRef"]["name"] == pool.name
                assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
                    max(1, replicas.min), replicas.max)
                assert "replicas" not in spec
                validate(hpa, latest_version(), strict=True)
            else:
                assert spec["replicas"] == replicas.min
        for pool in plan.pools:
            assert config.clusters[pool.name].max_context == pool.context
            vllm = deployments[pool.name]["spec"]["template"]["spec"]["containers"][0]
            args = vllm["args"]
            assert args[-len(pool.vllm_args):] == list(pool.vllm_args)
            assert args.count("--served-model-name") == 1
            assert vllm["resources"]["limits"]["nvidia.com/gpu"] == str(pool.gpus_per_replica)
            validate(deployments[pool.name], latest_version(), strict=True)
    assert hpas == {}  # none for a canary pool or a fixed-size model
    plan_md = (out / "plan.md").read_text()
    rows = [line for line in plan_md.splitlines() if line.startswith("| `--")]
    assert len(rows) == sum(sum(a.startswith("--") for a in p.vllm_args)
                            for plan in plans for p in plan.pools)
    assert [row for row in rows if row.endswith("|  |")] == []  # every flag has its reason
    rendered = write_all(config, str(tmp_path / "rendered"))
    envoy_validate(next(p for p in rendered if p.endswith("envoy.yaml")))
    again = tmp_path / "again"
    onboard([str(EXAMPLES)], routing_file(tmp_path), str(again), namespace="llm")
    for path in written:
        relative = pathlib.Path(path).relative_to(out)
        assert (again / relative).read_bytes() == pathlib.Path(path).read_bytes()


def test_a_relative_local_model_path_is_refused_before_anything_is_written(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan`` reads a relative local path from here; a Deployment mounts it from the GPU node,
    where only an absolute path means anything."""
    models = tmp_path / "models"
    models.mkdir()
    text = (EXAMPLES / "contract-review.yaml").read_text().replace(
        "modelPath: hf://meta-llama/Llama-2-13b-chat-hf", "modelPath: weights/llama-13b")
    (models / "m.yaml").write_text(text)
    line = text.splitlines().index("  modelPath: weights/llama-13b") + 1
    out = tmp_path / "o"
    assert onboard_command(parse([str(models), "--config", routing_file(tmp_path), "--out",
                                  str(out)])) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{models / 'm.yaml'}:{line}: 'weights/llama-13b' is relative: a pod mounts a local "
        "modelPath from the GPU node (hostPath), which needs an absolute path like "
        "/mnt/models/NAME"]
    assert not out.exists()
    (models / "m.yaml").write_text(text.replace("weights/llama-13b", "/mnt/models/llama-13b"))
    assert onboard_command(parse([str(models), "--config", routing_file(tmp_path), "--out",
                                  str(out)])) == 0
