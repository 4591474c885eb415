"""CPU time of processes from ``/proc/<pid>/stat`` (utime + stime), their live children included.

Read before and after a run; the difference divided by the requests served is the CPU cost per
request, whatever the process does with its time (gRPC, parsing, logging, metrics, GC).
"""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its last ')'.
    return text[text.rindex(")") + 2:].split()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                out += [int(c) for c in handle.read().split()]
        except OSError:
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (0 if it is gone)."""
    total = 0.0
    stack = [pid]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        fields = _stat(current)
        if fields is None:
            continue
        # Fields 14 and 15 of stat (utime, stime); the list starts at field 3 (state).
        total += (int(fields[11]) + int(fields[12])) / _TICK
        stack += _children(current)
    return total


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: max(0.0, after.get(name, 0.0) - value) for name, value in before.items()}
