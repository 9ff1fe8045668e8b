"""Keep freed host memory in the process, so a CPU training step reuses mapped pages instead of faulting in new ones.

glibc's malloc serves a large block (above ``M_MMAP_THRESHOLD``, 128 KiB to 32 MiB, adjusted at run time) with its
own ``mmap`` and gives it back with ``munmap`` when it is freed, and it trims the top of the heap back to the OS
past ``M_TRIM_THRESHOLD``. Every activation and gradient of a training step is such a block: each step maps them
again and the kernel zero-fills every page on first touch (a minor page fault, about 0.2-1 us per 4 KiB page). On
a DiT-S/2 step that is hundreds of thousands of faults, a sizeable part of the step on CPU.

``retain_host_memory()`` sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to their largest values (blocks up to
2 GiB come from the heap, and the heap is not trimmed) and ``M_TOP_PAD`` to 64 MiB (the heap grows in large steps),
the ``mallopt(3)`` equivalent of ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``.
From the second step on, the step's tensors are served from memory the process already holds. The cost: the
process keeps its peak host memory until it exits. Nothing is computed differently. Elsewhere than glibc Linux
(macOS, musl, Windows) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
_INT_MAX = 2**31 - 1  # mallopt takes an int
TOP_PAD = 64 * 2**20

_applied: bool | None = None


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def retain_host_memory() -> bool:
    """Apply the allocator settings once per process (module doc); True when they are in effect."""
    global _applied
    if _applied is None:
        libc = _glibc()
        ok = libc is not None
        if ok:
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            for param, value in ((M_MMAP_THRESHOLD, _INT_MAX), (M_TRIM_THRESHOLD, _INT_MAX), (M_TOP_PAD, TOP_PAD)):
                ok = bool(libc.mallopt(param, value)) and ok
        _applied = ok
    return _applied


__all__ = ["retain_host_memory"]
