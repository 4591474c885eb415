"""settle_heap: a serving process's start-up objects leave the collector's reach, young
collections become rarer, and cyclic garbage made while serving is still freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a child: the test process's own collector must stay as pytest set it.
CHILD = textwrap.dedent("""
    import gc, weakref
    from sidecar_runtime.process.heap import YOUNG_THRESHOLD, settle_heap

    class Node:
        pass

    startup = [Node() for _ in range(1000)]
    middle, old = gc.get_threshold()[1:]
    settle_heap()
    assert gc.get_freeze_count() >= len(startup), gc.get_freeze_count()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old), gc.get_threshold()

    # Serving: cycles that only the collector can free, made past the young threshold.
    freed = []
    for i in range(3 * YOUNG_THRESHOLD):
        a, b = Node(), Node()
        a.other, b.other = b, a
        weakref.finalize(a, freed.append, i)
        del a, b
    assert len(freed) >= YOUNG_THRESHOLD, len(freed)
    print("ok")
""")


def test_settle_heap_freezes_start_up_and_still_frees_cycles() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
