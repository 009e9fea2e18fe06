"""glibc malloc settings for service processes that move large messages.

A 1 MB tensor passes through several 1 MB buffers per request: the message bytes, the parsed
protobuf, the response, its encoding. With glibc's defaults each buffer that size can be
mapped fresh and unmapped again when freed (or the heap trimmed back), and a fresh mapping
costs a page fault for every 4 KiB page on first touch, which on these VMs is about a
millisecond per megabyte. A 1 MB echo between two uvloop processes measured 2.4 ms at p50
with the defaults and 0.86 ms with these settings; `benchmarks/bench_frames.py` shows the effect on
both transports.

The settings: allocations up to 32 MiB (glibc's largest mmap threshold) come from the heap, and
up to 256 MiB of freed heap stays mapped for the next request. The cost is memory: a process
keeps its high-water mark of message buffers, up to that much, instead of returning it at
once. `SWITCHYARD_MALLOC=default` keeps glibc's defaults; an operator's own
`MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` wins (nothing is changed then); off glibc
this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os

from switchyard.errors import InvalidArgument

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Applies the settings above unless told not to; True if this changed glibc's settings."""
    choice = os.environ.get("SWITCHYARD_MALLOC", "keep")
    if choice not in ("keep", "default"):
        raise InvalidArgument(f"SWITCHYARD_MALLOC={choice!r}: use keep (the default) or default")
    if choice == "default" or any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.warning("glibc refused the malloc settings for large messages; keeping its defaults")
    return ok
