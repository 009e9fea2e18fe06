"""A deliberately awkward child for supervisor tests: serves grpc health, spawns a grandchild
(`sleep`), writes both pids to a file, and ignores SIGTERM, so only the group kill stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from switchyard.grpcio import ServerOptions, start_server


async def serve(port: int) -> None:
    server = await start_server([], ServerOptions(port=port))
    await server.server.wait_for_termination()


def main(port: int, pid_file: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}\n")
    asyncio.run(serve(port))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
