"""extproc.admission's leases: unguessable and never handed out twice, a forked worker included."""

from __future__ import annotations

import os
import re

from extproc import admission
from extproc.admission import new_lease


def test_leases_are_96_random_bits_in_hex_and_never_repeat() -> None:
    """Across several refills of the pool the leases drawn from it are all different, each
    24 hex digits (the ratelimit service's lease alphabet)."""
    leases = [new_lease() for _ in range(admission._POOL_BYTES // admission._LEASE_BYTES * 5 + 7)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", lease) for lease in leases)
    assert len(set(leases)) == len(leases)


def test_a_forked_child_draws_leases_its_parent_never_draws() -> None:
    """Workers are forked: a child that went on from its parent's pool would hand out the
    parent's next leases, and one request's settlement could release another's."""
    new_lease()  # the pool holds leases not drawn yet
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next leases, to the parent
        try:
            os.close(read)
            os.write(write, ",".join(new_lease() for _ in range(20)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read().split(",")
    os.waitpid(pid, 0)
    parent = [new_lease() for _ in range(20)]
    assert len(child) == 20 and not set(child) & set(parent)
