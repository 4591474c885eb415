"""The ``llm-sidecar`` command line (docs: Commands)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from routing.errors import ConfigError
from sidecar_runtime.process.logs import configure
from sidecar_runtime.process.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-sidecar",
        description="Envoy ext_proc and rate-limit services in front of vLLM pools. Settings "
                    "also come from LLM_SIDECAR_* environment variables "
                    "(e.g. LLM_SIDECAR_REDIS_URL=redis://:pass@host:6379/0).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole gateway here: Envoy, extproc, ratelimit, "
                                   "vLLM simulators; Ctrl-C stops it")
    up.add_argument("--config", default=None,
                    help="routing YAML (default: the example config shipped in the package; "
                         "with --models, a built-in base of services, ports and auth, and the "
                         "file may declare no clusters or models)")
    up.add_argument("--models", default=None, metavar="DIR",
                    help="serve every LLMModel in DIR on simulated pods sized by its plan; a "
                         "file added, changed or removed there takes effect while it runs")
    up.add_argument("--gpus", default=None, metavar="FILE",
                    help="with --models: GPU catalog entries and nodes (as `plan --gpus`)")
    up.add_argument("--extproc-metrics-port", type=int, default=9101,
                    help="extproc's /metrics and /healthz (default 9101)")
    up.add_argument("--ratelimit-metrics-port", type=int, default=9102,
                    help="ratelimit's /metrics and /healthz (default 9102)")

    from extproc.adapters.main import add_arguments as extproc_args
    extproc_args(sub.add_parser("extproc", help="the ext_proc gRPC service"))

    rl = sub.add_parser("ratelimit", help="the rate-limit gRPC service (Envoy RLS v3)")
    try:
        from ratelimit.main import add_arguments as ratelimit_args
    except ImportError:
        rl.add_argument("--config", required=True)
    else:
        ratelimit_args(rl)

    render = sub.add_parser(
        "render", help="write envoy.yaml (Envoy bootstrap), ratelimit.yaml (descriptors) and "
                       "envoyfilter.yaml (Istio) for a routing YAML",
        description="Checks the routing YAML (as `check` does), then writes DIR/envoy.yaml, "
                    "DIR/ratelimit.yaml and DIR/envoyfilter.yaml. Envoy reads its bootstrap once: "
                    "after changing services, render again and restart Envoy; after changing "
                    "clusters too, unless envoy.dynamic_pools is on (then a render into the same "
                    "folder applies pool changes live); models, keys, limits and canary changes "
                    "reach extproc and ratelimit live.")
    render.add_argument("--config", required=True, help="routing YAML")
    render.add_argument("--out", required=True, help="output directory")
    render.add_argument("--watch", action="store_true",
                        help="keep running and render again whenever the routing YAML changes "
                             "(a mounted ConfigMap's update too): with envoy.dynamic_pools a "
                             "running Envoy applies pool changes at once; a file that does not "
                             "load is reported and the last good render kept")

    check = sub.add_parser("check", help="validate a routing YAML: exit 0 (warnings, if any, "
                                         "on stderr as FILE:LINE: warning: ...), or 1 with one "
                                         "FILE:LINE: message per problem")
    check.add_argument("--config", required=True, help="the routing YAML to check")

    sub.add_parser("schema", help="print the routing YAML's JSON Schema (for editors: "
                                  "# yaml-language-server: $schema=FILE)")

    canary = sub.add_parser("canary", help="canary vs stable side by side, from extproc's "
                                           "/metrics, with a verdict per measure, then each "
                                           "model's canary verdict on its shadow pairs "
                                           "(promote, hold, rollback, with every figure)")
    canary.add_argument("--metrics", required=True,
                        help="extproc metrics URL, e.g. http://127.0.0.1:9101/metrics")
    canary.add_argument("--model", default=None, help="one model (default: every model with "
                                                      "canary traffic)")
    canary.add_argument("--min-samples", type=int, default=30,
                        help="requests each variant needs before a verdict (default 30)")

    from llmmodel.onboard_cli import add_onboard_arguments
    from llmmodel.operator_cli import add_operator_arguments
    from llmmodel.plan_cli import add_plan_arguments
    add_plan_arguments(sub.add_parser(
        "plan", help="size the vLLM pools of LLMModel files: per pool the GPU class, GPUs per "
                     "replica and every vLLM flag with its reason; exit 1 with FILE:LINE when "
                     "a model is invalid or fits no GPU",
        description="Plans each LLMModel without writing anything: one pool per "
                    "context, its GPUs, tensor parallelism inside a NUMA node, and vLLM's flags, "
                    "each with the fact it rests on."))
    add_onboard_arguments(sub.add_parser(
        "onboard", help="write DIR/routing.yaml (ROUTING plus the models' pools, limits and "
                        "canaries), DIR/k8s/ (vLLM Deployments, Services, InferencePools, "
                        "monitoring, the LLMModel CRD) and DIR/plan.md from LLMModel files"))
    add_operator_arguments(sub.add_parser(
        "operator", help="the in-cluster LLMModel controller (kopf): applies what onboard "
                         "writes and reports .status.plan and conditions"))

    from simulator import add_arguments as sim_args
    sim_args(sub.add_parser("sim", help="the vLLM simulator (OpenAI API as vLLM serves it)"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings()
    except ValidationError as err:  # a bad LLM_SIDECAR_* variable: one line each
        for problem in err.errors():  # never its value: it may be a password or a key
            name = "LLM_SIDECAR_" + "_".join(str(part) for part in problem["loc"]).upper()
            print(f"llm-sidecar: {name}: {problem['msg']}", file=sys.stderr)
        return 2
    configure(settings.log_level, service=f"llm-sidecar-{args.command}")
    try:
        return _dispatch(args, settings)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "check":
        from routing.loader import check_config
        for warning in check_config(args.config):
            print(str(warning), file=sys.stderr)
        return 0
    if args.command == "schema":
        from routing.jsonschema import schema_text
        sys.stdout.write(schema_text())
        return 0
    if args.command == "render":
        from routing.loader import load_config
        from routing.render import write_all
        from sidecar_runtime.process.reload import path_signature
        signature = path_signature(args.config)  # before reading: --watch sees a change made now
        config = load_config(args.config)
        try:
            written = write_all(config, args.out)
        except (FileExistsError, NotADirectoryError) as exc:
            print(f"llm-sidecar render: --out {args.out}: {exc.strerror}: give a folder",
                  file=sys.stderr)
            return 1
        except PermissionError as exc:
            print(f"llm-sidecar render: --out {args.out}: {exc.strerror}", file=sys.stderr)
            return 1
        for path in written:
            print(path, flush=True)
        if args.watch:
            from llm_sidecar.render_watch import watch
            from routing.render.envoy import bootstrap_fingerprint
            return watch(args.config, args.out, bootstrap_fingerprint(config), signature)
        return 0
    if args.command == "up":
        from llm_sidecar.up import run as up_run
        return up_run(args)
    if args.command == "extproc":
        from extproc.adapters.main import run as extproc_run
        return extproc_run(args, settings)
    if args.command == "ratelimit":
        from ratelimit.main import run as ratelimit_run
        code: int = ratelimit_run(args, settings)
        return code
    if args.command == "canary":
        from extproc.canary.cli import run as canary_run
        return canary_run(args)
    if args.command == "plan":
        from llmmodel.plan_cli import plan_command
        return plan_command(args)
    if args.command == "onboard":
        from llmmodel.onboard_cli import onboard_command
        return onboard_command(args)
    if args.command == "operator":
        from llmmodel.operator_cli import operator_command
        return operator_command(args)
    if args.command == "sim":
        from simulator import run as sim_run
        return sim_run(args, settings.log_level)
    raise AssertionError(args.command)
