"""``python -m llm_sidecar`` is ``llm-sidecar``."""

from llm_sidecar.cli import main

raise SystemExit(main())
