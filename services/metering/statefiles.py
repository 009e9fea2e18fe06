"""Where the ledger's secrets and state live on disk, and their modes.

Every file is 0600 in a 0700 folder of its own:
- the SQLite ledger file (and its -wal/-shm, which SQLite creates with the file's mode);
- the anchor: `<sqlite file>.anchor/audit-head.json` by default;
- the audit key: by default not beside the database but in the user's configuration,
  `$XDG_CONFIG_HOME/switchyard/audit-keys/<ledger id>.key` (else `~/.config/...`), where
  `<ledger id>` is a hash of the database's path or URL (without its password). A key file
  `audit.key` from an older version, beside the SQLite file, is moved there once (for a
  server database, `var/audit.key` is copied).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from sqlalchemy.engine import make_url

from switchyard import layout

log = logging.getLogger(__name__)


def private_dir(folder: Path) -> Path:
    """`folder`, created if needed, mode 0700."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def sqlite_file(url: str) -> Path | None:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        return Path(parsed.database).resolve()
    return None


def protect_sqlite(url: str) -> None:
    """The SQLite ledger file (and its WAL files, if there yet) 0600: usage is not world-readable."""
    db = sqlite_file(url)
    if db is None:
        return
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        if path.exists():
            os.chmod(path, 0o600)


def key_folder() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "") or str(Path.home() / ".config")
    return Path(base) / "switchyard" / "audit-keys"


def default_key_path(url: str) -> Path:
    """The audit key's default file (module docstring), moving a legacy one beside the database."""
    db = sqlite_file(url)
    ident = str(db) if db is not None else make_url(url).render_as_string(hide_password=True)
    path = private_dir(key_folder()) / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.key"
    if path.exists():
        return path
    if db is not None and (db.parent / "audit.key").exists():
        legacy = db.parent / "audit.key"
        shutil.move(str(legacy), path)
        os.chmod(path, 0o600)
        log.warning("moved the audit key %s to %s (not beside the database)", legacy, path)
    elif db is None and (layout.data_root() / "var" / "audit.key").exists():
        # Server databases shared `var/audit.key` before: copied, as others may still use it.
        shutil.copyfile(layout.data_root() / "var" / "audit.key", path)
        os.chmod(path, 0o600)
    return path


def default_anchor_path(db: Path) -> Path:
    """`<sqlite file>.anchor/audit-head.json`, moving a legacy `<sqlite file>.audit-head.json`."""
    path = private_dir(db.with_name(db.name + ".anchor")) / "audit-head.json"
    legacy = db.with_name(db.name + ".audit-head.json")
    if legacy.exists() and not path.exists():
        shutil.move(str(legacy), path)
        os.chmod(path, 0o600)
    return path
