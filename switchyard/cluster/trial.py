"""The trial in the main job: `tiny-lm` on cpu-eager (reference) versus xla, on Temporal.

The spec is the same JSON an operator pastes into the Temporal UI; the workflow runs on the
cluster's trial worker, and the report is read back from the ledger and written as HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.cluster.demo import Endpoints

WORKFLOW = "TrialWorkflow"


@dataclass
class TrialOutcome:
    trial_id: str
    status: str
    verdicts: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    reports: dict[str, Path] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def demo_spec(ep: Endpoints) -> dict[str, Any]:
    """A small, quick trial: few iterations, batch 1 and 4, so the demo stays in minutes."""
    return {
        "model": {"name": "tiny-lm"},
        "inputs": {
            "seed": 7,
            "tensors": [{"name": "input_ids", "datatype": "INT64", "shape": [4, 16], "low": 0, "high": 64}],
        },
        "paths": [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager", "precision": "fp32"},
            {"name": "xla", "executor": "xla", "mode": "lazy", "precision": "fp32"},
        ],
        "reference": "cpu-eager",
        "criteria": {"logits": True},
        "performance": {"warmup": 3, "min_iterations": 20, "min_seconds": 1.0, "batch_sizes": [1, 4]},
        "team": "demo",
        "description": "switchyard demo: is xla a fit for tiny-lm on this machine?",
    }  # fmt: skip


async def run_trial(ep: Endpoints, out_dir: Path, run: str) -> TrialOutcome:
    from temporalio.client import Client

    client = await Client.connect(ep.temporal, namespace=ep.namespace)
    trial_id = f"demo-tiny-lm-{run}"
    result = await client.execute_workflow(WORKFLOW, demo_spec(ep), id=trial_id, task_queue=ep.task_queue)
    report = result if isinstance(result, dict) else json.loads(str(result))
    outcome = TrialOutcome(trial_id, str(report.get("status", "completed")), report=report)
    for path in report.get("paths", []):
        outcome.verdicts[path.get("name", "?")] = path.get("verdict", "?")
        outcome.reasons[path.get("name", "?")] = path.get("reason", "")
    outcome.reports["trial (json)"] = _write_json(out_dir / f"{trial_id}.json", report)
    return outcome


def _write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path
