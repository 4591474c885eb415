"""A child started with :func:`sidecar_runtime.process.procs.start` dies with its parent, even when the
parent is killed outright (SIGKILL: no handler runs), so ``up``, the ``--workers`` supervisor
and the tests leave no orphans behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.harness.waits import wait_for

PARENT = """
import sys, time
from sidecar_runtime.process.procs import start
child = start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
print(child.process.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie awaiting its reaper is gone too
        return handle.read().split(") ", 1)[1][0] != "Z"


def test_a_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not alive(child), timeout=10, what="the child to follow its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
