"""The wheel's layout (the metadata is in pyproject.toml).

The repository keeps its folders (`services/`, `workflows/`, `clients/`, `migrations/`); in
site-packages they become `switchyard_services`, `switchyard_workflows`,
`switchyard_clients` and `switchyard_migrations`, so no generic top-level name is installed.
The code still imports `services.…`: `switchyard/layout.py` answers those names in a wheel.
Package data: the checkpoints and built-in model repository, py.typed, the migrations and
alembic.ini (copied into switchyard_migrations at build time).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
MAPPED = {
    "switchyard_services": "services",
    "switchyard_workflows": "workflows",
    "switchyard_clients": "clients",
}


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "switchyard_migrations"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(HERE / "alembic.ini", target / "alembic.ini")


packages = find_packages(include=["switchyard", "switchyard.*"])
package_dir = {"switchyard": "switchyard"}
for name, folder in MAPPED.items():
    package_dir[name] = folder
    # namespace too: some folders (services/executor/backends) have no __init__.py
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    packages += [name, *(f"{name}.{p}" for p in found)]
package_dir["switchyard_migrations"] = "migrations"
packages += ["switchyard_migrations", "switchyard_migrations.versions"]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "switchyard": ["py.typed", "gen/py.typed", "models/checkpoints/*.safetensors", "models/builtin/*/*"],
        "switchyard_migrations": ["*.py", "*.mako", "versions/*.py", "alembic.ini"],
        **{name: ["*.toml", "*.md"] for name in MAPPED},
        "switchyard_services.router": ["*.toml"],
    },
    cmdclass={"build_py": BuildPy},
)
