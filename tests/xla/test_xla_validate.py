"""`switchyard models validate NAME --backend xla`, as an operator runs it from the main
environment: the command re-runs itself under the XLA interpreter (SWITCHYARD_XLA_PYTHON,
PJRT_DEVICE=CPU), loads the repository entry on XLA, runs its example inputs, and prints the
compatibility findings: the compilations of a model that lowers whole, and the host fallback
of one that does not (tests/xla/fallback_model.py), with outputs checked against model.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from clients.model_admin import add_model
from switchyard.models.repository import Repository, seed_builtins
from tests.conftest import ROOT
from tests.xla import fallback_model
from tests.xla.conftest import require_xla_env

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    seed_builtins(root)
    source = tmp_path_factory.mktemp("median")
    (source / "model.toml").write_text(
        f'format = "factory"\n[factory]\nfunction = "{fallback_model.FACTORY}"\n'
    )
    save_file(fallback_model.seeded_state(), str(source / "model.safetensors"))
    add_model(root, "median-head", source, allowed_factories=("tests",))
    return root


def _validate(repository: Path, names: str, xla_python: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}  # the command sets it
    env.update(SWITCHYARD_XLA_PYTHON=xla_python, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "clients.cli", "models", "validate", *names.split(), "--backend", "xla"]
    argv += ["--repository", str(repository), "--allow-factory", "tests", *extra]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def reports(repository: Path) -> dict[str, dict[str, Any]]:
    """Both entries' --json reports from one command, as an operator validates several: the
    torch_xla start-up is paid once; each report is still its own load's (counter deltas taken
    around that model's load, so the mlp's compilations and the median's fallback stay apart)."""
    done = _validate(repository, "mlp median-head", require_xla_env(), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    listed: list[dict[str, Any]] = json.loads(done.stdout)
    assert [r["model"] for r in listed] == ["mlp", "median-head"]
    return {r["model"]: r for r in listed}


def test_validate_on_xla_reports_compilations_of_a_model_that_lowers_whole(
    repository: Path, reports: dict[str, dict[str, Any]]
) -> None:
    report = reports["mlp"]
    entry = Repository(repository).get("mlp", "")
    assert report["backend"] == "xla" and report["model"] == "mlp"
    assert report["sha256"] == entry.sha256  # the artifact checked is the one in the repository
    assert report["outputs"] == {"y": [2, 16]}  # the example batch of 2, as model.toml declares
    assert report["compilations"] >= 1 and report["compile_time_s"] > 0
    assert report["fallback_ops"] == {}


def test_validate_on_xla_names_a_host_fallback_and_prints_it(
    repository: Path, reports: dict[str, dict[str, Any]]
) -> None:
    xla = require_xla_env()
    report = reports["median-head"]
    assert report["outputs"] == {"y": [2, 1]}
    assert any("median" in op for op in report["fallback_ops"]), report["fallback_ops"]
    text = _validate(repository, "median-head", xla)  # what an operator reads
    assert text.returncode == 0, text.stderr[-3000:]
    assert "median-head:1 on xla" in text.stdout and "OK" in text.stdout
    assert "fallback ops: aten::median" in text.stdout


def test_validate_on_xla_without_its_environment_says_how_to_set_it(repository: Path, tmp_path: Path) -> None:
    done = _validate(repository, "mlp", str(tmp_path / "no-python"))
    assert done.returncode != 0
    assert "SWITCHYARD_XLA_PYTHON" in done.stderr and "has no torch_xla" in done.stderr
