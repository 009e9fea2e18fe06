"""Process checks and stops that tests and benchmarks share."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie counts as dead (it ran its course, only its exit status is left)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (children of children included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(") ", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def stop_child(process: subprocess.Popen[str]) -> int:
    """SIGTERM (a service drains on it), up to 30 s to exit, then SIGKILL; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
