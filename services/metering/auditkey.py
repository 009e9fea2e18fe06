"""The audit chain's secret and its head digest, both kept outside the database.

Each audit row's hash is an HMAC-SHA256 under a key the database does not hold, so someone
who can write the tables cannot recompute a valid chain after changing or removing rows.
The key comes from (first found):
- SWITCHYARD_AUDIT_KEY: the key itself (at least 32 characters);
- SWITCHYARD_AUDIT_KEY_FILE: a file holding it (a mounted Secret in production);
- by default a file of its own, not beside the database (services/metering/statefiles.py:
  `~/.config/switchyard/audit-keys/<ledger id>.key`), 0600 in a 0700 folder, created on
  first use.

The head digest (the "anchor") is the chain's last seq and hash, signed with a key derived
from the audit key, written periodically to a file outside the database
(SWITCHYARD_AUDIT_ANCHOR; default `<sqlite file>.anchor/audit-head.json`, 0600 in a 0700
folder). `verify` checks the chain against it, so deleting the newest rows, TRUNCATE, or a
head row put back are detected even when the database's own head row was reset. The anchor
only moves forward: a writer never replaces a newer anchor with an older one (replicas that
share the file take a lock to write it).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.metering import statefiles
from services.metering.metering_errors import BadInput
from switchyard import layout

log = logging.getLogger(__name__)

ENV_KEY = "SWITCHYARD_AUDIT_KEY"
ENV_KEY_FILE = "SWITCHYARD_AUDIT_KEY_FILE"
ENV_ANCHOR = "SWITCHYARD_AUDIT_ANCHOR"
MIN_KEY = 32
ROOT = layout.data_root()  # the checkout, or the working directory of an installed wheel


def default_anchor(url: str) -> Path | None:
    """SWITCHYARD_AUDIT_ANCHOR, else `<sqlite file>.anchor/audit-head.json`; None for a server
    database with no anchor configured (verify then relies on the database's head row)."""
    configured = os.environ.get(ENV_ANCHOR, "")
    if configured:
        return Path(configured)
    db = statefiles.sqlite_file(url)
    return statefiles.default_anchor_path(db) if db is not None else None


def load_key(url: str) -> bytes:
    """The audit key (see the module docstring for where it comes from)."""
    value = os.environ.get(ENV_KEY, "")
    if value:
        if len(value) < MIN_KEY:
            raise BadInput(f"{ENV_KEY} is {len(value)} characters; use at least {MIN_KEY} random ones")
        return value.encode()
    file = os.environ.get(ENV_KEY_FILE, "")
    path = Path(file) if file else statefiles.default_key_path(url)
    if not file and not path.exists():
        _create_key_file(path)
    try:
        data = path.read_bytes().strip()
    except OSError as exc:
        raise BadInput(f"cannot read audit key file {path} ({exc.strerror}); set {ENV_KEY_FILE}") from None
    if len(data) < MIN_KEY:
        raise BadInput(f"audit key file {path} holds {len(data)} bytes; it needs at least {MIN_KEY}")
    return data


def _create_key_file(path: Path) -> None:
    """Write a fresh random key with 0600 permissions; a concurrent creator's key wins."""
    statefiles.private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process made the key first: keep theirs
        log.warning("created audit key file %s (keep it outside the database's backups)", path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def anchor_key(key: bytes) -> bytes:
    return hmac.new(key, b"switchyard audit anchor v1", hashlib.sha256).digest()


@dataclass(frozen=True)
class Anchor:
    seq: int
    hash: str
    written_us: int


def _anchor_mac(key: bytes, seq: int, digest: str, written_us: int) -> str:
    body = json.dumps([seq, digest, written_us], separators=(",", ":")).encode()
    return hmac.new(anchor_key(key), body, hashlib.sha256).hexdigest()


class AnchorError(Exception):
    """The anchor file exists but is unreadable or not signed with this key."""


def read_anchor(path: Path | None, key: bytes) -> Anchor | None:
    """The anchor at `path` (None when there is none yet); AnchorError when it is not genuine."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        anchor = Anchor(int(raw["seq"]), str(raw["hash"]), int(raw["written_us"]))
        mac = str(raw["mac"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AnchorError(f"anchor file {path} is unreadable ({exc})") from None
    if not hmac.compare_digest(mac, _anchor_mac(key, anchor.seq, anchor.hash, anchor.written_us)):
        raise AnchorError(f"anchor file {path} is not signed with this audit key")
    return anchor


def write_anchor(path: Path, key: bytes, seq: int, digest: str, written_us: int, force: bool = False) -> bool:
    """Write the anchor atomically (0600) if it is newer than the one there; True when written.

    An anchor there that does not verify raises AnchorError and stays as it is, unless
    `force` (the operator's re-anchoring after an investigation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        old = None if force else read_anchor(path, key)
        if old is not None and old.seq >= seq:
            return False
        body = {"seq": seq, "hash": digest, "written_us": written_us}
        body["mac"] = _anchor_mac(key, seq, digest, written_us)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps(body, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    return True
