"""The executor process's own memory, read at each Describe: its resident set from
/proc/self/statm and, where torch.cuda has been initialised, the bytes its caching allocator
holds for live tensors. A trial samples it through its measurement and fits how it grows per
request (workflows/tensor/growth.py), so a path that keeps memory alive on every call is named.

Reading statm is one small read (microseconds); `torch.cuda.memory_allocated` reads the
allocator's counters and never initialises CUDA in a process that has not (an uninitialised
process has no allocation to report, and says so with `device_reported` false).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

STATM = Path("/proc/self/statm")


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int  # 0 where /proc is not readable (not Linux)
    device_allocated_bytes: int = 0
    device_reported: bool = False


def rss_bytes(statm: Path = STATM) -> int:
    """The resident set size: statm's second field, in pages."""
    try:
        fields = statm.read_text().split()
    except OSError:
        return 0
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def sample() -> ProcessMemory:
    """The process's memory now (host, and CUDA where this process uses it)."""
    rss = rss_bytes()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return ProcessMemory(rss)
    allocated = sum(int(torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count()))
    return ProcessMemory(rss, allocated, True)
