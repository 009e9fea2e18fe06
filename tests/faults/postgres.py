"""A PostgreSQL server of the fault harness's own, on a host of its own (`pg`), that a fault
can stop and start: the machine's server on 127.0.0.1:5432 is shared and unreachable from
the namespaces.

Debian's binaries (/usr/lib/postgresql/<version>/bin) refuse to run as root, so initdb,
pg_ctl and the server run as the `postgres` user (`runuser`), on a data directory of their
own under /tmp (pytest's tmp directories are root's, mode 0700). The server listens on the
`pg` host's address, so metering reaches it across a link, and on a Unix socket in that
directory, through which the test reads the ledger from the root namespace (a socket is a
file: namespaces do not hide it). Trust authentication: the address exists only inside the
namespaces this harness makes. `close` stops it and removes the directory.
"""

from __future__ import annotations

import contextlib
import glob
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.faults.netns import Host

USER = "postgres"
PORT = 5432
DATABASE = "ledger"


def binaries() -> Path | None:
    """The newest installed server's bin directory (None: no PostgreSQL server here)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


def unavailable() -> str:
    """Why the harness cannot run a server of its own ("" when it can)."""
    if binaries() is None:
        return "no PostgreSQL server binaries under /usr/lib/postgresql"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no `{USER}` user to run PostgreSQL as"
    return "" if shutil.which("runuser") else "no `runuser` (util-linux)"


class PgServer:
    def __init__(self, host: Host) -> None:
        self.host = host
        bin_dir = binaries()
        assert bin_dir is not None, unavailable()
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="switchyard-faults-pg-"))
        account = pwd.getpwnam(USER)
        shutil.chown(self.root, account.pw_uid, account.pw_gid)
        self.data = self.root / "data"
        self._as_user("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8")
        hba = self.data / "pg_hba.conf"
        hba.write_text(hba.read_text() + f"host all all {host.address.rsplit('.', 1)[0]}.0/24 trust\n")

    @property
    def url(self) -> str:
        """Across the link, from the other hosts."""
        return f"postgresql+psycopg://{USER}@{self.host.address}:{PORT}/{DATABASE}"

    @property
    def local_url(self) -> str:
        """Through the Unix socket, from the root namespace (the test's own reads)."""
        return f"postgresql+psycopg://{USER}@/{DATABASE}?host={self.root}&port={PORT}"

    def _as_user(self, tool: str, *args: str, timeout_s: float = 60) -> None:
        command = self.host.command("runuser", "-u", USER, "--", str(self.bin / tool), *args)
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)}: {done.stdout[-1500:]} {done.stderr[-1500:]}")

    def start(self) -> None:
        options = f"-c listen_addresses={self.host.address} -p {PORT} -k {self.root} -c fsync=on"
        log = str(self.root / "server.log")
        self._as_user("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "-t", "60", "start")

    def create_database(self) -> None:
        create = f"CREATE DATABASE {DATABASE}"
        command = ["psql", "-h", str(self.root), "-U", USER, "-d", "postgres", "-c", create]
        subprocess.run(command, check=True, capture_output=True, timeout=30)

    def stop(self, mode: str = "fast") -> None:
        """`fast`: what `pg_ctl restart` and a failover do, every session ended (57P01)."""
        self._as_user("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def log_text(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
