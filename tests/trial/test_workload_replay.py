"""A workload captured from router traffic, replayed in a trial: correctness and performance
run the captured requests in order with their real shapes, and the report names the workload,
its sha256 and its request count and shape distribution. A changed file or a wrong sha256
fails the trial's inputs with both hashes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from tests.trial.stack import Stack
from tests.trial.trial_helpers import QUICK_PERF, captured_workload, run_trial
from workflows.spec.trial_spec import SpecError, parse_spec

ROWS = (1, 3, 2, 1, 4)


def _send(address: str) -> list[np.ndarray]:
    client = triton.InferenceServerClient(address)
    sent = []
    try:
        for i, rows in enumerate(ROWS):
            x = np.random.default_rng(i).standard_normal((rows, 64)).astype(np.float32)
            tensor = triton.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.infer("mlp", [tensor])
            sent.append(x)
    finally:
        client.close()
    return sent


async def test_a_captured_workload_is_replayed_in_a_trial(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = await captured_workload(stack, "mlp", "cpu-replay", _send, tmp_path, monkeypatch)

    spec = {
        "model": {"name": "mlp"},
        "inputs": {"workload": workload["id"], "sha256": workload["sha256"]},
        "paths": [
            {"name": "cpu", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-again", "executor": "cpu", "mode": "eager"},
        ],
        "reference": "cpu",
        "performance": {**QUICK_PERF, "batch_sizes": [1], "batch_buckets": [1, 2, 4]},
        "timeouts": {"heartbeat_s": 10, "activity_s": 300, "max_attempts": 1},
        "team": "test",
    }
    report = await run_trial(stack, spec, "replay")
    assert report["status"] == "completed", report
    inputs = report["inputs"]
    assert (inputs["workload"], inputs["workload_sha256"]) == (workload["id"], workload["sha256"])
    distribution = inputs["workload_distribution"]
    assert distribution["requests"] == len(ROWS)
    assert distribution["shapes"]["x"] == {"1x64": 2, "3x64": 1, "2x64": 1, "4x64": 1}
    assert distribution["bytes"]["total"] == sum(ROWS) * 64 * 4
    verdict = report["verdicts"]["cpu-again"]
    assert verdict["criteria"]["correctness"]["result"] == "pass", verdict  # the same path: identical
    assert verdict["criteria"]["correctness"]["reason"].endswith("; not checked under load: workload replay")
    scenario = report["paths"]["cpu-again"]["performance"]["scenarios"][0]
    assert scenario["iterations"] >= 10

    bad = {**spec, "inputs": {"workload": workload["id"], "sha256": "0" * 64}}
    failed = await run_trial(stack, bad, "replay-bad")
    text = str(failed)
    assert workload["sha256"] in text and "0" * 64 in text


def test_a_workload_spec_needs_its_sha256_and_nothing_else() -> None:
    base = {
        "model": {"name": "mlp"},
        "paths": [
            {"name": "a", "executor": "cpu", "mode": "eager"},
            {"name": "b", "executor": "cpu", "mode": "eager"},
        ],
        "reference": "a",
    }
    with pytest.raises(SpecError, match=r"inputs\.sha256"):
        parse_spec({**base, "inputs": {"workload": "mlp.0123"}})
    with pytest.raises(SpecError, match=r"inputs\.workload"):
        parse_spec({**base, "inputs": {"workload": "mlp.0123", "sha256": "a" * 64, "file": "x.npz"}})
    spec = parse_spec({**base, "inputs": {"workload": "mlp.0123", "sha256": "a" * 64}})
    assert spec.inputs.workload == "mlp.0123" and spec.inputs.workload_sha256 == "a" * 64
