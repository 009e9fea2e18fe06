"""Fixtures for the attacks on the ledger: its databases (SQLite and PostgreSQL, each test its
own, from tests/metering), the anchor's own folder, and the metering service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.metering.conftest import db_url, migrated_templates, pg_unavailable
from tests.security.ledger_attack import KEY, Metering

__all__ = ["anchor", "db_url", "metering", "migrated_templates", "pg_unavailable"]


@pytest.fixture
def anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "anchor"
    folder.mkdir(mode=0o700)
    path = folder / "audit-head.json"
    monkeypatch.setenv("SWITCHYARD_AUDIT_KEY", KEY)
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR", str(path))
    monkeypatch.setenv("SWITCHYARD_AUDIT_ANCHOR_S", "0.1")
    return path


@pytest.fixture
async def metering(db_url: str, anchor: Path) -> AsyncIterator[Metering]:
    svc = Metering(db_url)
    try:
        yield svc
    finally:
        await svc.stop()
