"""``python -m llm_sidecar.docs_gen [--check]``."""

from llm_sidecar.docs_gen import main

raise SystemExit(main())
