"""The executor's own memory as Describe reports it (services/executor/process_memory.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from services.executor import process_memory


def test_rss_is_statm_resident_pages_and_zero_where_unreadable(tmp_path: Path) -> None:
    statm = tmp_path / "statm"
    statm.write_text("5000 1200 300 10 0 900 0\n")
    assert process_memory.rss_bytes(statm) == 1200 * os.sysconf("SC_PAGE_SIZE")
    assert process_memory.rss_bytes(tmp_path / "missing") == 0


def test_this_process_reports_its_rss_and_cuda_only_once_used() -> None:
    now = process_memory.sample()
    assert now.rss_bytes > 0
    # a process that never initialised CUDA has no allocation to report (and is not made to)
    initialised = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    assert now.device_reported == initialised
    if not initialised:
        assert now.device_allocated_bytes == 0 and not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
