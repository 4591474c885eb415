"""``llm-sidecar canary --metrics URL``: fetch extproc's metrics and print the comparison."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from extproc.canary.report import render, render_all, report
from extproc.canary.verdict import verdicts_text


def run(args: argparse.Namespace) -> int:
    try:
        with urllib.request.urlopen(args.metrics, timeout=10) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"llm-sidecar canary: cannot read {args.metrics}: {exc}", file=sys.stderr)
        return 1
    if args.model:
        print(render(report(text, args.model, args.min_samples), args.model))
    else:
        print(render_all(text, args.min_samples))
    verdicts = verdicts_text(text)
    if verdicts:
        print()
        print(verdicts)
    return 0
