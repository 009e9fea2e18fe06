"""Where things are: in a checkout of the repository, or in an installed wheel.

A checkout keeps its folders as they are (`services/`, `workflows/`, `clients/`,
`migrations/`, `alembic.ini` at the top). The wheel must not put such generic names into
site-packages, so it installs them as `switchyard_services`, `switchyard_workflows`,
`switchyard_clients` and `switchyard_migrations` (setuptools' package-dir mapping in
pyproject.toml; setup.py copies alembic.ini into `switchyard_migrations`). The code keeps
importing `services.…`: in a wheel, `install_aliases()` (called by `import switchyard`)
installs an importer that answers those names with the installed modules, the very same
module objects, and only when nothing else on sys.path provides them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent  # the switchyard package
ALIASES = {
    "services": "switchyard_services",
    "workflows": "switchyard_workflows",
    "clients": "switchyard_clients",
}


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


class _AliasImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`services.x` -> the installed `switchyard_services.x` (same module object)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, dot, rest = fullname.partition(".")
        real = ALIASES.get(head)
        if real is None:
            return None
        if not dot:
            # the top-level name: only where nothing on sys.path provides it
            if importlib.machinery.PathFinder.find_spec(head) is not None:
                return None
            if importlib.util.find_spec(real) is None:
                return None
        elif getattr(sys.modules.get(head), "__name__", "") != real:
            return None  # `head` is someone else's package: not ours to answer
        # First on sys.meta_path: otherwise the path finder would load `services.x` a second
        # time from the aliased package's __path__, as a different module object.
        return importlib.util.spec_from_loader(fullname, self, origin=real + dot + rest)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        assert spec.origin is not None
        return importlib.import_module(spec.origin)

    def exec_module(self, module: ModuleType) -> None:
        return None  # executed when imported under its real name


def install_aliases() -> None:
    """In a wheel (no checkout), make `services`, `workflows` and `clients` importable."""
    if checkout_root() is not None:
        return
    if not any(isinstance(f, _AliasImporter) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasImporter())
