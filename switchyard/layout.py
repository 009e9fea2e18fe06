"""Where things are: in a checkout of the repository, or in an installed wheel.

Code is found by the import system alone: a checkout on PYTHONPATH and the wheel (setup.py)
hold the same packages under the same names. What is not imported is found here: the state
folder (`var/` in the checkout, else the working directory) and the ledger's migrations,
which a checkout keeps in `migrations/` beside `alembic.ini` and the wheel installs as
`switchyard_migrations` with alembic.ini inside.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent  # the switchyard package


def checkout_root() -> Path | None:
    """The repository checkout this code runs from, or None when installed from the wheel."""
    top = HERE.parent
    if (top / "pyproject.toml").is_file() and (top / "services").is_dir():
        return top
    return None


def data_root() -> Path:
    """Where relative state (var/) goes: the checkout, or the working directory when installed."""
    return checkout_root() or Path.cwd()


def migrations_dir() -> Path:
    root = checkout_root()
    if root is not None:
        return root / "migrations"
    spec = importlib.util.find_spec("switchyard_migrations")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the ledger migrations are missing: reinstall switchyard")
    return Path(next(iter(spec.submodule_search_locations)))


def alembic_ini() -> Path:
    root = checkout_root()
    return root / "alembic.ini" if root is not None else migrations_dir() / "alembic.ini"
