"""The wheel's layout (the metadata is in pyproject.toml).

The wheel installs each package under the name the code imports it by: `switchyard` (the
shared ground), `services`, `workflows` and `clients`, each from its folder, so an installed
copy and a checkout on PYTHONPATH resolve every import the same way, by the standard import
system alone. The migrations are not imported (alembic reads them by path): they go into
`switchyard_migrations`, with alembic.ini copied there at build time. Package data: the
checkpoints and built-in model repository, py.typed, the migrations and alembic.ini.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
TOPS = ("services", "workflows", "clients")
PACKAGES = [
    *find_packages(include=["switchyard", "switchyard.*"]),
    # namespace too: some folders (services/executor/backends) have no __init__.py
    *find_namespace_packages(include=[*TOPS, *(f"{top}.*" for top in TOPS)], exclude=["*.__pycache__"]),
]


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "switchyard_migrations"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(HERE / "alembic.ini", target / "alembic.ini")


setup(
    packages=[*PACKAGES, "switchyard_migrations", "switchyard_migrations.versions"],
    package_dir={"switchyard_migrations": "migrations"},
    package_data={
        "switchyard": ["py.typed", "gen/py.typed", "models/checkpoints/*.safetensors", "models/builtin/*/*"],
        "switchyard_migrations": ["*.py", "*.mako", "versions/*.py", "alembic.ini"],
        **{top: ["*.toml", "*.md"] for top in TOPS},
        "services.router": ["*.toml"],
    },
    cmdclass={"build_py": BuildPy},
)
