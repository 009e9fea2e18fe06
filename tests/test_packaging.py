"""The wheel: a working `switchyard` from any directory, no generic top-level names, a client
install without torch.

The wheel is built from a copy of this checkout's tracked files (pip wheel, no build
isolation: setuptools is in the main environment). Two fresh virtual environments, used from
a directory outside the checkout with no PYTHONPATH:
- the server install: the wheel without dependencies into a venv that sees the main
  environment's packages (a .pth file: the main environment is itself a venv, so this stands
  in for --system-site-packages and keeps the test offline and fast). `switchyard --version`,
  `switchyard models list` and `switchyard up` (until every service is SERVING) work, and the
  code that runs is the installed one.
- the client install: the wheel with its core dependencies from the package index, no extras
  (a venv cached by the hash of pyproject.toml; later runs reinstall only the wheel):
  `switchyard --version` and `switchyard infer --help` work and torch is
  not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard import __version__
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
WHERE = "import switchyard, services.router.paths as p; print(switchyard.__file__, p.__name__)"
GENERIC = ("services", "workflows", "clients", "migrations", "tests", "benchmarks", "tools")


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


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("server-venv")
    venv.EnvBuilder(with_pip=False).create(home)
    main_site = sysconfig.get_paths()["purelib"]
    (_site_packages(home) / "main-env.pth").write_text(main_site + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "--no-deps", "-q",
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    yield home


def test_the_wheel_installs_no_generic_top_level_names(wheel: Path, server_venv: Path) -> None:
    site = _site_packages(server_venv)
    for name in GENERIC:
        assert not (site / name).exists(), f"{name}/ in site-packages"
    for name in ("switchyard", "switchyard_services", "switchyard_workflows", "switchyard_migrations"):
        assert (site / name).is_dir()
    assert (site / "switchyard_migrations" / "alembic.ini").is_file()
    assert (site / "switchyard" / "models" / "checkpoints" / "mlp.safetensors").stat().st_size > 0
    assert (site / "switchyard" / "models" / "builtin" / "mlp" / "model.toml").is_file()


def test_server_install_version_models_and_up_from_tmp(server_venv: Path, tmp_path: Path) -> None:
    env = _clean_env(server_venv)
    env["PATH"] += f":{Path(sys.executable).parent}"  # the dependencies' scripts (temporal)
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
    assert str(_site_packages(server_venv)) in where.stdout, where  # the installed copy, not the checkout
    assert "switchyard_services.router.paths" in where.stdout  # one module object, its real name

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
        "[router]\nport = 0\n"
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
