"""``python -m ratelimit --config FILE``: the service without the llm-sidecar CLI around it."""

from __future__ import annotations

import argparse
import sys

from ratelimit.main import add_arguments, run
from sidecar_runtime.process.logs import configure
from sidecar_runtime.process.settings import Settings


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m ratelimit", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args()
    settings = Settings()
    configure(settings.log_level, service="llm-sidecar-ratelimit")
    return run(args, settings)


if __name__ == "__main__":
    sys.exit(main())
