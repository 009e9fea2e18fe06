"""A service process started ahead of need, for `switchyard up`'s restarts.

    python -m clients.local_cluster.standby MODULE[,MODULE...] LOG -- ARGS...

imports the MODULEs (the slow part of a service's start: torch and the executor's server, some
seconds on a busy host), says `ready` on stdout, from then on writes its output to the file LOG
(appending), and waits for one line on stdin. On that line the process becomes
`python -m clients.cli ARGS...`, with its imports already done; at end of input (nobody needed
it) it exits 0. The supervisor keeps one standby per executor, so a crashed executor's
replacement only has to load its models.
"""

from __future__ import annotations

import importlib
import os
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 2:
        print(
            "usage: python -m clients.local_cluster.standby MODULE[,MODULE...] LOG -- ARGS...",
            file=sys.stderr,
        )
        return 2
    modules, log = [m for m in argv[0].split(",") if m], argv[1]
    for module in modules:
        importlib.import_module(module)
    print("ready", flush=True)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, sys.stdout.fileno())
    os.close(out)
    if not sys.stdin.readline():
        return 0
    sys.argv = ["switchyard", *argv[3:]]
    from clients.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
