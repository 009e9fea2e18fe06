"""A trial whose first latency interval straddles its bound measures more paired blocks and
says so (issue 30: the trial extends its own measurement, up to a budget).

One trial on the shared stack (real Temporal dev server, CPU executor, evaluator, ledger): an
A/A trial of the built-in mlp (the reference's own path as the candidate: one loaded instance
measured in alternation with itself), judged against no allowance at all (bound 1.0) at 99.9%.
An identical path's ratio lies near 1.0, so its interval straddles that bound unless the
bootstrap misses the true ratio (about 1 run in 1,000 at that level), and the measurement
must extend itself. The stopping rule's own cases are tests/trial/test_extension.py.
"""

from __future__ import annotations

import re
from typing import Any

from temporalio.worker import Replayer

from tests.trial.stack import Stack
from tests.trial.trial_helpers import run_trial
from workflows.trial import TrialWorkflow

BRACKET = re.compile(r"([0-9.]+) \[([0-9.]+), ([0-9.]+)\] at 99.9%")
PLANNED, BLOCKS, BUDGET = 40, 8, 60


def _spec() -> dict[str, Any]:
    return {
        "model": {"name": "mlp"},
        "inputs": {"seed": 3, "tensors": [{"name": "x", "datatype": "FP32", "shape": [1, 64]}]},
        "paths": [{"name": n, "executor": "cpu", "mode": "eager"} for n in ("ref", "same")],
        "reference": "ref",
        "performance": {
            "scenarios": ["single-stream"],
            "warmup": 2,
            "min_iterations": PLANNED,
            "min_seconds": 0.0,
            "blocks": BLOCKS,
            "max_extra_requests": BUDGET,
        },
        "policy": {"max_p95_regression": 0.0, "confidence": 0.999, "max_latency_drift": 0.0},
        "timeouts": {"heartbeat_s": 10, "activity_s": 300, "max_attempts": 2},
        "team": "test",
    }


async def test_a_straddling_interval_extends_the_measurement_and_the_report_says_so(stack: Stack) -> None:
    report = await run_trial(stack, _spec(), "extend")
    single = {p: report["paths"][p]["performance"]["scenarios"][0] for p in ("ref", "same")}
    assert report["paths"]["same"]["performance"]["interleaved_with"] == ["ref"]
    record = single["same"]["extension"]
    assert record == single["ref"]["extension"], "one extension for the group"
    before = BRACKET.fullmatch(record["before"]["same"])
    assert before, record
    ratio, low, high = (float(g) for g in before.groups())
    assert low <= 1.0 < high, record  # the interval at the planned blocks straddled the bound
    extra = record["extra_requests"]
    assert extra > 0 and 1 <= record["rounds"] <= 2 and record["budget"] == BUDGET, record
    assert record["level"] == 1 - 0.001 / 4  # looks after the planned one are stricter
    for scenario in single.values():  # every path measured the extra paired blocks
        assert len(scenario["blocks_ms"]) == BLOCKS + record["extra_blocks"]
        assert scenario["iterations"] == PLANNED + extra
    latency = report["verdicts"]["same"]["criteria"]["latency"]
    assert record["text"] in latency["reason"]
    if record["stopped"] == "budget":
        assert BUDGET - 2 * 5 < extra <= BUDGET and latency["result"] == "inconclusive", latency
        assert record["text"].startswith(f"measurement extended: budget of {BUDGET} extra requests spent")
    else:
        assert record["stopped"] == "decided" and latency["result"] in ("pass", "fail"), latency
        assert record["text"].startswith(f"measurement extended: interval decided after +{extra} ")
    print(f"at the planned blocks {ratio} [{low}, {high}]:", latency["reason"])
    # the loop ran inside the one activity: the workflow replays deterministically
    history = await stack.env.client.get_workflow_handle(report["trial_id"]).fetch_history()
    converter = stack.env.client.data_converter  # the payloads are sealed: replay opens them
    await Replayer(workflows=[TrialWorkflow], data_converter=converter).replay_workflow(history)
