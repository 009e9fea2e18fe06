"""A candidate made 2x slower is rejected on latency with an interval that excludes the bound;
one made 1.05x slower passes or is inconclusive, never rejected (issue 30).

One trial on the shared stack (real Temporal dev server, CPU executor, evaluator, ledger): the
reference and both candidates are versions of tests/trial/planted_speed.py on one executor,
so they are measured together in alternating blocks, with the spec's default plan for
single-stream and the default policy (+10% allowed, 95%).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from temporalio.worker import Replayer

from clients.model_admin import add_model
from tests.trial import planted, planted_speed
from tests.trial.stack import Stack
from tests.trial.trial_helpers import run_trial
from workflows.trial import TrialWorkflow

pytestmark = pytest.mark.alone  # a speed verdict: the host to itself (tests/conftest.py)

MODEL = "planted-speed"
INTERVAL = re.compile(r"p95 ratio ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]")


def _spec() -> dict[str, Any]:
    return {
        "model": {"name": MODEL, "version": "honest"},
        "inputs": {"seed": 7, "tensors": [{"name": "x", "datatype": "FP32", "shape": [1, planted.FEATURES]}]},
        "paths": [{"name": "reference", "executor": "cpu", "mode": "eager"}]
        + [{"name": v, "executor": "cpu", "mode": "eager", "version": v} for v in ("slow2", "slow105")],
        "reference": "reference",
        "performance": {"scenarios": ["single-stream"]},
        "timeouts": {"heartbeat_s": 10, "activity_s": 300, "max_attempts": 2},
        "team": "test",
    }


def _interval(report: dict[str, Any], path: str) -> tuple[str, float, float, str]:
    latency = report["verdicts"][path]["criteria"]["latency"]
    found = INTERVAL.search(latency["reason"])
    assert found, latency
    return latency["result"], float(found.group(2)), float(found.group(3)), latency["reason"]


async def test_twice_as_slow_is_rejected_and_five_percent_slower_is_not(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    work = tmp_path_factory.mktemp("planted-speed")
    for version in planted_speed.FACTORS:
        source = planted_speed.write_version(work / version, version)
        add_model(stack.repository, MODEL, source, version=version, allowed_factories=("tests",))
    report = await run_trial(stack, _spec(), "speed")
    assert report["paths"]["reference"]["performance"]["interleaved_with"] == ["slow2", "slow105"]
    result, low, _, reason = _interval(report, "slow2")
    assert result == "fail" and low > 1.1, reason
    assert report["verdicts"]["slow2"]["verdict"] == "REJECT"
    assert "measured in alternating blocks on host " in reason
    result, _, _, reason = _interval(report, "slow105")
    assert result in ("pass", "inconclusive"), reason
    assert report["verdicts"]["slow105"]["criteria"]["correctness"]["result"] == "pass"
    print("slow2:", _interval(report, "slow2")[3])
    print("slow105:", reason)
    # the group's turns and its one measurement replay deterministically (a restarted worker)
    history = await stack.env.client.get_workflow_handle(report["trial_id"]).fetch_history()
    converter = stack.env.client.data_converter  # the payloads are sealed: replay opens them
    await Replayer(workflows=[TrialWorkflow], data_converter=converter).replay_workflow(history)
