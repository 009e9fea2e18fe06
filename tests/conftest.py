"""Shared test fixtures. Every service a test needs is started by the tests themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The suite runs its services in plaintext, by name (the services refuse to start with neither
# certificates nor this): the tests of identities and authorisation give their servers
# certificates explicitly (tests/security/), which wins over this for those servers.
os.environ["SWITCHYARD_SECURITY_INSECURE"] = "true"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama-style test model of tests/gen_models.py, built once a session (its tests
    only read it)."""
    from tests.gen_models import build_llama

    return build_llama(tmp_path_factory.mktemp("llama") / "llama-tiny")
