"""The CPU threads a command may ask for, checked before it reads or draws anything.

``check_threads(n, what)``: a thread count (``--threads``, ``engine.cpu_threads``) within ``max_threads()``, at most
``THREADS_PER_CPU`` per CPU this process may use (and never above ``MAX_THREADS``). More intra-op threads than CPUs
only compete for them (two runs of 2 threads each on 2 cores ran at a fraction of their speed), and a count in the
thousands starts as many threads (``sample --threads 10000``: 20,000, the machine unusable for minutes; 100000: a
segfault inside torch). Light: a command checks its ``--threads`` before it imports torch.
"""

from __future__ import annotations

import os

THREADS_PER_CPU = 4
MAX_THREADS = 4096  # engine.cpu_threads' own bound (runs/sections.py)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_threads() -> int:
    """The most intra-op threads a command may ask for here: ``THREADS_PER_CPU`` per usable CPU."""
    return min(MAX_THREADS, THREADS_PER_CPU * usable_cpus())


def check_threads(n: int, what: str = "--threads") -> int:
    """``n`` when it is a thread count this machine can run (0: torch's default); ValueError in one line naming
    ``what`` otherwise."""
    if n < 0:
        raise ValueError(f"{what} must be >= 0 (0: torch's default), got {n}")
    if n > max_threads():
        cpus = usable_cpus()
        raise ValueError(
            f"{what} {n} is more than {max_threads()} ({THREADS_PER_CPU} per CPU; this process may use {cpus}): "
            f"more threads than CPUs only compete for them; use at most {cpus}, or 0 for torch's default"
        )
    return n
