"""Child processes of `switchyard up`, each in a session of its own that dies with its parent.

Each service runs in its own session (process group), so a signal to the group reaches the
helpers it spawns too (inductor compile workers, the Temporal server's children), and the
terminal's Ctrl-C reaches only the supervisor. Every child is started with PR_SET_PDEATHSIG
(Linux prctl, through ctypes): the kernel SIGKILLs it when the supervisor dies, even by
SIGKILL, so a killed `switchyard up` leaves no orphaned services behind. On other systems the
children outlive a killed supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import IO

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs this child when the supervisor thread exits."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def start_in_session(
    argv: Sequence[str], env: Mapping[str, str], stdin: int, stdout: int | IO[bytes], stderr: int | IO[bytes]
) -> asyncio.subprocess.Process:
    """`argv` as the leader of a new session, killed by the kernel when this process dies."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=dict(env),
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def kill_group(pgid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signals a child's whole session (its pid is the group id); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def exit_reason(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
