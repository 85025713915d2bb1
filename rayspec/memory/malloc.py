"""Keep freed memory in the process instead of handing it back to the kernel (glibc, CPU).

Each decode step allocates and frees the same large buffers (logits of a batch are 3-13 MB).
glibc returns big freed blocks to the kernel (munmap, or trimming the heap with brk) once its
thresholds say so, and the next step then takes a page fault for every 4 KB it touches again.
Which of the two happens depends on the process's allocation history: a long run of the
trainer's answer stage at batch 16 spent more than half its CPU time in the kernel (about
500k page faults/s, measured with strace and /proc/PID/stat), and ran 3x faster with the
settings below. They fix the thresholds: blocks up to 32 MB (glibc's maximum for this) come
from the heap, and the heap is not trimmed, so a process keeps its peak footprint, as
torch's CUDA caching allocator does.
Opt out with RAYSPEC_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
_done = False


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds once per process; False where that is not possible."""
    global _done
    if _done:
        return True
    if os.environ.get("RAYSPEC_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return False
    ok = (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
          and mallopt(M_TOP_PAD, 64 << 20) == 1)
    _done = ok
    return ok
