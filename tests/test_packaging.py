"""The wheel: a working `switchyard` from any directory, its packages under the names the code
imports (nothing aliased), a client install without torch.

The wheel is built from a copy of this checkout's tracked files (pip wheel, no build
isolation: setuptools is in the main environment). Two fresh virtual environments, used from
a directory outside the checkout with no PYTHONPATH:
- the server install: the wheel (`switchyard[server,control]`) into a venv that holds exactly
  the dependencies the wheel declares, with theirs: the closure of its Requires-Dist for those
  extras, resolved against the main environment's installed distributions and linked from
  there by each distribution's RECORD (a top-level folder no other distribution has files in
  as one link, a shared one file by file), so the test stays offline and takes seconds
  instead of downloading torch, yet a dependency that pyproject.toml forgot is missing there
  (the main environment, built from requirements/, is not visible). `switchyard --version`,
  `switchyard models list` and `switchyard up` (until every service is SERVING) work, the code
  that runs is the installed one, and it is imported by the standard import system alone: each
  module under its own name, no finder of ours on sys.meta_path.
- the client install: the wheel with its core dependencies from the package index, no extras
  (a venv cached by the hash of pyproject.toml; later runs reinstall only the wheel):
  `switchyard --version` and `switchyard infer --help` work and torch is
  not installed.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import venv
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from switchyard import __version__
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
# which files answer, under which names, and who finds them: the standard finders alone
WHERE = """
import sys
import clients.cli as c, services.router.path_registrar as p, switchyard, workflows
print(switchyard.__file__, c.__file__, p.__file__, workflows.__file__)
print(c.__name__, p.__name__)
print([type(f).__module__ for f in sys.meta_path])
"""
INSTALLED = ("switchyard", "services", "workflows", "clients", "switchyard_migrations")
NOT_INSTALLED = ("migrations", "tests", "benchmarks", "tools", "switchyard_services", "switchyard_clients")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy of the tracked files: an in-tree build would leave build/ in the checkout
    source = tmp_path_factory.mktemp("source") / "switchyard"
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, timeout=60)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(source)],
        check=True, capture_output=True, timeout=300, cwd=out,
    )  # fmt: skip
    (found,) = out.glob("switchyard-*.whl")
    return found


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{home / 'bin'}:/usr/bin:/bin"
    env["SWITCHYARD_SECURITY_INSECURE"] = "true"
    return env


def _site_packages(home: Path) -> Path:
    (site,) = (home / "lib").glob("python3*/site-packages")
    return site


SERVER_EXTRAS = frozenset({"server", "control"})


def declared_closure(wheel: Path, extras: frozenset[str]) -> list[metadata.Distribution]:
    """The installed distributions the wheel needs with `extras`: its Requires-Dist (markers
    evaluated for those extras), then each one's own, transitively, with the extras asked of it."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(archive.read(name).decode())
    todo = [(Requirement(r), extras) for r in meta.get_all("Requires-Dist") or []]
    found: dict[str, metadata.Distribution] = {}
    asked: dict[str, set[str]] = {}
    problems: list[str] = []
    while todo:
        req, wanted = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in {"", *wanted}):
            continue
        key = canonicalize_name(req.name)
        try:
            dist = found.get(key) or metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req} (installed: {dist.version})")
        new = set(req.extras) - asked.get(key, set())
        if key in found and not new:
            continue
        found[key] = dist
        asked.setdefault(key, set()).update(req.extras)
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or []]
    assert not problems, f"the main environment does not satisfy what the wheel declares: {problems}"
    return list(found.values())


def _name(dist: metadata.Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def _tops(dist: metadata.Distribution) -> set[str]:
    """The top-level names `dist` has files under in its site-packages (not its scripts)."""
    return {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def link_distributions(dists: list[metadata.Distribution], home: Path) -> int:
    """Links every file of `dists` into the venv at `home`, at the same place relative to its
    site-packages (scripts land in its bin/; Python scripts are left out: their shebang names
    the main environment's interpreter). A top-level folder that no other installed
    distribution has a file in is one link (torch/, its dist-info); one that others share (a
    namespace such as google/, __pycache__/) is linked file by file, so no file of a
    distribution outside `dists` is reachable. Returns the number of files of `dists` linked."""
    site = _site_packages(home)
    wanted = {_name(d) for d in dists}
    shared = {top for d in metadata.distributions() if _name(d) not in wanted for top in _tops(d)}
    linked = 0
    for dist in dists:
        for top in _tops(dist) - shared:
            source = Path(os.path.normpath(str(dist.locate_file(top))))
            if source.is_dir() and not (site / top).exists():
                (site / top).symlink_to(source, target_is_directory=True)
        for entry in dist.files or []:
            source = Path(os.path.normpath(str(dist.locate_file(entry))))
            target = Path(os.path.normpath(site / entry))
            if not source.is_file():
                continue
            if target.parent != site and (site / Path(str(entry)).parts[0]).is_symlink():
                linked += 1  # under a folder linked whole
                continue
            if target.exists() or (target.parent == home / "bin" and source.read_bytes()[:2] == b"#!"):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)
            linked += 1
    return linked


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("server-venv")
    venv.EnvBuilder(with_pip=False).create(home)
    dists = declared_closure(wheel, SERVER_EXTRAS)
    assert {"torch", "sqlalchemy", "temporalio"} <= {canonicalize_name(d.metadata["Name"]) for d in dists}
    assert link_distributions(dists, home) > 1000
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "--no-deps", "-q",
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    yield home


def test_the_wheel_installs_the_packages_under_their_own_names(wheel: Path, server_venv: Path) -> None:
    site = _site_packages(server_venv)
    for name in NOT_INSTALLED:
        assert not (site / name).exists(), f"{name}/ in site-packages"
    for name in INSTALLED:
        assert (site / name).is_dir(), f"{name}/ missing from site-packages"
    assert (site / "clients" / "cli.py").is_file()
    assert (site / "services" / "router" / "routes.example.toml").is_file()
    assert (site / "switchyard_migrations" / "alembic.ini").is_file()
    assert (site / "switchyard" / "models" / "checkpoints" / "mlp.safetensors").stat().st_size > 0
    assert (site / "switchyard" / "models" / "builtin" / "mlp" / "model.toml").is_file()


def test_server_install_version_models_and_up_from_tmp(server_venv: Path, tmp_path: Path) -> None:
    env = _clean_env(server_venv)
    bin_ = server_venv / "bin"
    version = subprocess.run(
        [str(bin_ / "switchyard"), "--version"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.returncode == 0 and version.stdout.strip() == f"switchyard {__version__}", version
    where = subprocess.run(
        [str(bin_ / "python"), "-c", WHERE],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    files, names, finders = where.stdout.splitlines()
    site = str(_site_packages(server_venv))
    assert all(f.startswith(site) for f in files.split()), files  # the installed copy, not the checkout
    assert names.split() == ["clients.cli", "services.router.path_registrar"]
    assert "switchyard" not in finders and "layout" not in finders, finders  # the standard finders only
    alias = subprocess.run(
        [str(bin_ / "python"), "-c", "import switchyard_services"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert alias.returncode != 0 and "ModuleNotFoundError" in alias.stderr, alias
    module = subprocess.run(
        [str(bin_ / "python"), "-m", "clients.cli", "--version"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert module.stdout.strip() == f"switchyard {__version__}", module

    def models_list() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_ / "switchyard"), "models", "list"], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip

    empty = models_list()  # nothing here yet: `switchyard up` seeds the built-ins
    assert empty.returncode == 0, empty.stdout + empty.stderr

    config = tmp_path / "cluster.toml"
    config.write_text(
        'state_dir = "state"\n[temporal]\nport = 0\nui_port = 0\n'
        "[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nopenai_port = 0\n"
        '[executors.cpu]\nport = 0\nmodels = ["mlp"]\n[executors.xla]\nenabled = false\n'
    )
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [str(bin_ / "switchyard"), "up", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )  # fmt: skip
    try:
        state = tmp_path / "state" / "cluster.json"
        deadline = time.monotonic() + 240
        while not state.exists():
            assert up.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        status = subprocess.run(
            [str(bin_ / "switchyard"), "up", "status", "--config", str(config)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr
        services = json.loads(state.read_text())["services"]
        assert {"metering", "router", "executor-cpu", "trial-worker"} <= set(services)
        assert (tmp_path / "state").is_dir() and not (_site_packages(server_venv) / "var").exists()
        models = models_list()  # the built-ins from the wheel's package data, seeded by `up`
        assert models.returncode == 0, models.stdout + models.stderr
        assert "mlp" in models.stdout and "tiny-lm" in models.stdout, models.stdout
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        code = up.wait(90)
    assert code == 0, log.read_text()[-3000:]


def _client_venv(wheel: Path) -> Path:
    """A venv with the wheel and its core dependencies, cached by the hash of pyproject.toml
    (which declares them): the first run installs them from the index, later runs reinstall
    only the freshly built wheel."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))
    home = cache / f"client-{digest}"
    pip = [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "-q"]
    if (home / ".ready").exists():
        extra = ["--no-deps", "--force-reinstall"]
    else:
        shutil.rmtree(home, ignore_errors=True)
        venv.EnvBuilder(with_pip=False).create(home)
        extra = []
    install = subprocess.run([*pip, *extra, str(wheel)], capture_output=True, text=True, timeout=540)
    assert install.returncode == 0, install.stdout + install.stderr
    (home / ".ready").touch()
    return home


def test_client_install_has_no_torch(wheel: Path, tmp_path: Path) -> None:
    home = _client_venv(wheel)
    env = _clean_env(home)
    torch = subprocess.run(
        [str(home / "bin" / "python"), "-c", "import torch"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert torch.returncode != 0, "torch is installed in the client-only install"
    version = subprocess.run(
        [str(home / "bin" / "switchyard"), "--version"], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert version.stdout.strip() == f"switchyard {__version__}", version
    infer = subprocess.run(
        [str(home / "bin" / "switchyard"), "infer", "--help"], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert infer.returncode == 0 and "--model" in infer.stdout, infer.stdout + infer.stderr
