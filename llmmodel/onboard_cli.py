"""The ``onboard`` subcommand's arguments and its run: paths written on stdout, problems on
stderr (``FILE:LINE: message``, exit 1), never a traceback for bad input."""

from __future__ import annotations

import argparse
import os
import re
import sys

from routing.errors import ConfigError

_NAMESPACE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _namespace(value: str) -> str:
    if not _NAMESPACE.match(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a Kubernetes namespace: lower-case letters, digits and '-', at "
            "most 63 characters")
    return value


def add_onboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="LLMModel files, or folders of them (*.yaml)")
    parser.add_argument("--config", required=True, metavar="ROUTING",
                        help="the routing YAML the models are added to (not changed)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="writes DIR/routing.yaml, DIR/k8s/ and DIR/plan.md")
    parser.add_argument("--gpus", metavar="FILE", default=None,
                        help="GPU catalog entries and nodes added to the built-in catalog")
    parser.add_argument("--namespace", metavar="NS", default="default", type=_namespace,
                        help="namespace of the Kubernetes objects and pool Services "
                             "(default: default)")


def onboard_command(args: argparse.Namespace) -> int:
    from llmmodel.onboard import onboard
    out = str(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"llm-sidecar onboard: --out {out}: not a folder: give a folder (it is created "
              "when missing)", file=sys.stderr)
        return 1
    try:
        written = onboard(list(args.files), str(args.config), out, args.gpus,
                          namespace=str(args.namespace))
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 1
    except OSError as exc:
        where = exc.filename or out
        print(f"llm-sidecar onboard: cannot write {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
