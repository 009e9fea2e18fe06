"""The ledger's files are private: the database, the anchor and the key 0600 in 0700 folders of
their own, and the audit key is not beside the database by default."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.metering import statefiles
from services.metering.ledger import Ledger
from services.metering.records import Actor


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("SWITCHYARD_AUDIT_KEY", "SWITCHYARD_AUDIT_KEY_FILE", "SWITCHYARD_AUDIT_ANCHOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def test_the_ledger_database_anchor_and_key_are_private(home: Path) -> None:
    db = home / "ledgers" / "ledger.db"
    db.parent.mkdir()
    ledger = Ledger.open(f"sqlite:///{db}")
    try:
        ledger.audit.append(Actor("root", "test"), "test.action", "thing/1", "ok", {})
        assert ledger.audit.write_anchor()
        assert ledger.audit.anchor_path is not None
        anchor = ledger.audit.anchor_path
    finally:
        ledger.close()
    assert mode(db) == 0o600
    assert anchor.parent != db.parent and mode(anchor) == 0o600 and mode(anchor.parent) == 0o700
    keys = list(statefiles.key_folder().iterdir())
    assert len(keys) == 1 and mode(keys[0]) == 0o600 and mode(keys[0].parent) == 0o700
    assert not (db.parent / "audit.key").exists()
    assert home / "config" in keys[0].parents  # not beside the database


def test_a_legacy_key_and_anchor_beside_the_database_are_moved(home: Path) -> None:
    db = home / "ledger.db"
    first = Ledger.open(f"sqlite:///{db}")
    try:
        first.audit.append(Actor("root", "test"), "test.action", "thing/1", "ok", {})
        assert first.audit.write_anchor()
        key = first.tx.audit_key
        assert first.audit.anchor_path is not None
        legacy_anchor = db.with_name("ledger.db.audit-head.json")
        first.audit.anchor_path.rename(legacy_anchor)  # as an older version left them
    finally:
        first.close()
    key_file = next(statefiles.key_folder().iterdir())
    key_file.rename(db.parent / "audit.key")
    again = Ledger.open(f"sqlite:///{db}")
    try:
        assert again.tx.audit_key == key
        assert not (db.parent / "audit.key").exists() and not legacy_anchor.exists()
        assert again.audit.verify().ok  # the moved anchor still vouches for the chain
    finally:
        again.close()
