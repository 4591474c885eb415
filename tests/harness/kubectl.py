"""``kubectl kustomize``, the one kubectl command the tests run: it needs no cluster. kubectl
ships on this project's machine image, so CI runs these tests (``unavailable`` fails them
there rather than skip)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from typing import Any

import yaml

from tests.harness.ci import unavailable


def kustomize(folder: pathlib.Path | str) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize FOLDER`` builds (a failure fails the test)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        unavailable("kubectl")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
