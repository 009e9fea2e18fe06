"""A small filesystem of its own for a router's spool (a tmpfs mount), and a file that fills it.

Root only (mounting needs CAP_SYS_ADMIN; CI runs these as root): `unavailable` says why not.
`small_disk` unmounts even when the test inside fails (lazily, should a process still hold a
file there). `fill` writes until the disk refuses, as another writer on a shared volume would.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 16


def unavailable() -> str:
    """Why a tmpfs cannot be mounted here ("" when it can)."""
    if os.geteuid() != 0:
        return "mounting a small filesystem needs root (CI runs these as root)"
    probe = Path(f"/tmp/sy-mount-probe-{uuid.uuid4().hex[:6]}")
    probe.mkdir()
    try:
        made = subprocess.run(_mount(probe, 64), capture_output=True, text=True, timeout=10)
        if made.returncode != 0:
            return f"`mount -t tmpfs` fails here: {made.stderr.strip()}"
        subprocess.run(["umount", str(probe)], capture_output=True, timeout=10)
        return ""
    finally:
        probe.rmdir()


def _mount(where: Path, size_kb: int) -> list[str]:
    return ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0700", "tmpfs", str(where)]


@contextlib.contextmanager
def small_disk(where: Path, size_kb: int) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(_mount(where, size_kb), check=True, capture_output=True, timeout=10)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


def fill(directory: Path, name: str = "filler") -> Path:
    """A file that takes every free byte of `directory`'s filesystem (bounded by its size)."""
    path = directory / name
    st = os.statvfs(directory)
    with path.open("ab", buffering=0) as f, contextlib.suppress(OSError):
        for _ in range(2 * st.f_blocks * st.f_frsize // CHUNK + 2):  # a short write is a chunk too
            f.write(b"\0" * CHUNK)
    return path


def free_kb(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize // 1024
