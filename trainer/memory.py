"""Give freed host memory back to the operating system.

XLA's compiler allocates a few hundred MiB while it compiles a train step, and model
initialisation makes large temporaries; glibc keeps such freed memory in the process, so
resident memory stays at its high-water mark. ``release_free_memory`` asks glibc to return it
(``malloc_trim``). The training loop calls it after set-up and after each step that compiled
(a batch shape not seen before); in steady state it is never called, so steps do not pay for
re-faulting memory. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return None


def release_free_memory() -> bool:
    """Return freed heap memory to the OS; True when something was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
