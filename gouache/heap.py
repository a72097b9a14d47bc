"""Keep freed CPU memory in the process, so large tensors stop costing page faults.

glibc's malloc serves every block over its mmap threshold (128 KiB, raised as blocks are freed up
to 32 MiB) straight from the kernel and gives it back on free, and trims the heap's top once
128 KiB of it is free. A denoiser step allocates and frees activations of tens of MiB hundreds
of times, so every one of them faults in each of its pages afresh, zeroed by the kernel: on this
2-core machine a GELU writing 60 MiB of bf16 takes 44 ms that way and 33 ms from a kept heap, and
sd3-arch's denoiser on two 256 px and two 512 px images 7.18 s against 6.66 s; one 512 px request
(blocks of 32 MiB at most, which glibc's raised threshold already keeps) 4.81 s against 4.79 s
(`docs/fullsize.md`). With both thresholds at their limit, freed blocks stay in the heap for the
next step, as a GPU caching allocator keeps its blocks: the process's resident memory stays at
its peak instead of shrinking between steps.

Every gouache process does this first (the CLI and each process it starts: `children`);
`GOUACHE_MALLOC=system` leaves the C library's defaults. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters
_LIMIT = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Whether the C library now keeps freed memory (False: opted out, or not glibc)."""
    choice = os.environ.get("GOUACHE_MALLOC", "keep")
    if choice not in ("keep", "system"):
        raise ValueError(f"GOUACHE_MALLOC is 'keep' (the default) or 'system', not {choice!r}")
    if choice == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(parameter, _LIMIT) == 1 for parameter in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))
