"""Shared test fixtures. Every service a test needs is started by the tests themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
