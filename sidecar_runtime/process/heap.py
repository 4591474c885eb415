"""The garbage collector of a serving process: start-up objects set aside, young collections rarer.

A service builds almost everything it keeps at start-up (modules, its config, the servers) and,
while serving, allocates short-lived objects that reference counting frees. The cyclic collector
still ran often and long enough to cost: at saturation, ratelimit spent ~4 % of its CPU in it
(455 young and 3 full collections in one bench run, measured with ``gc.callbacks``), because

- a young collection runs whenever 700 more container objects are alive than at the last one,
  and the calls in flight (32 at a time, a few dozen objects each) hover around that number, so
  it ran every few calls while finding next to nothing to free;
- a full collection walked every object built at start-up (~80,000), again and again.

:func:`settle_heap`, called once the service serves, moves what exists then out of the
collector's reach (``gc.freeze``: it lives as long as the process anyway) and raises the young
generation's threshold, so that the in-flight working set no longer trips it. Cyclic garbage is
still collected, just in larger, rarer rounds: at most :data:`YOUNG_THRESHOLD` objects wait.
With both, the same run made 2 young collections and no full one. The older generations keep
Python's defaults.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Container objects allocated (net) before a young collection; Python's default is 700."""


def settle_heap() -> None:
    """Freeze what the process holds now and raise the young generation's threshold."""
    gc.collect()  # what start-up left as garbage goes now, not frozen for good
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
