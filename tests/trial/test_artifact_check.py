"""Every path's artifact sha256 is checked before it measures and recorded in the report: two
executors whose repositories hold different files for one model version are not compared.
Real Temporal dev server, two real CPU executors with their own repositories, real ledger."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import RunningExecutor, start_executor
from switchyard.models.manifest import file_sha256
from switchyard.models.repository import seed_builtins
from tests.trial.stack import Stack, set_prices
from tests.trial.trial_helpers import QUICK_PERF, run_trial, tiny_spec
from workflows.report.render import render


@pytest.fixture
async def other_weights(stack: Stack, tmp_path: Path) -> AsyncIterator[RunningExecutor]:
    """A CPU executor whose repository's tiny-lm version 1 has other weights (hashes consistent
    with its own model.toml, so the executor itself loads it without complaint)."""
    seed_builtins(tmp_path, ["tiny-lm"])
    folder = tmp_path / "tiny-lm"
    toml = (folder / "model.toml").read_text()
    tensors = load_file(folder / "1" / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + torch.full_like(tensors[first], 1e-3)
    for version in ("1", "perturbed"):
        target = folder / version / "model.safetensors"
        old = file_sha256(target)
        target.unlink()  # a hard link to the shipped file: never write through it
        save_file(tensors, target)
        toml = toml.replace(old, file_sha256(target))
    (folder / "model.toml").write_text(toml)
    executor = await start_executor(ExecutorConfig(backend="cpu", port=0, model_repository=str(tmp_path)))
    yield executor
    await executor.stop(0)


async def test_paths_with_different_artifacts_for_one_version_are_not_compared(
    stack: Stack, other_weights: RunningExecutor
) -> None:
    await set_prices(stack)
    spec = tiny_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-eager-2", "executor": "cpu", "mode": "eager"},
            {"name": "other-repo", "executor": other_weights.address, "mode": "eager"},
        ],
        performance={**QUICK_PERF, "batch_sizes": [1]},
    )
    report = await run_trial(stack, spec, "artifact")
    assert report["status"] == "completed"
    artifacts = report["artifacts"]
    shas = {path: entry["sha256"] for path, entry in artifacts["paths"].items()}
    assert all(re.fullmatch(r"[0-9a-f]{64}", sha) for sha in shas.values()), shas
    assert shas["cpu-eager"] == shas["cpu-eager-2"] != shas["other-repo"]
    assert artifacts["consistent"] is False
    error = report["paths"]["other-repo"]["errors"]["prepare"]
    assert error.startswith("FAILED_PRECONDITION: tiny-lm:default on other-repo has artifact sha256 ")
    assert shas["other-repo"] in error and shas["cpu-eager"] in error  # both hashes, named
    assert report["paths"]["other-repo"]["performance"] == {}  # nothing measured on it
    verdict = report["verdicts"]["other-repo"]
    assert verdict["verdict"] == "INCONCLUSIVE"
    assert "FAILED_PRECONDITION" in verdict["criteria"]["correctness"]["reason"]
    # the path with the same artifact is compared as usual
    assert report["verdicts"]["cpu-eager-2"]["criteria"]["correctness"]["result"] == "pass"
    page = render(report, "md")  # and the report says so where an operator reads it
    assert "Artifacts checked before measuring (paths DISAGREE)" in page and shas["other-repo"] in page
