"""The trial report as data: built in the workflow (pure, deterministic), stored in the ledger
as JSON, rendered to Markdown and HTML by workflows/render.py.

It carries what docs/architecture.md#trials asks of every figure: the system each path ran on
(device, versions,
host and which paths shared it), input sizes and seeds, configuration, and the comparison
basis, next to the verdict per path with the reason per criterion.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime
from typing import Any

from workflows.compatibility import findings
from workflows.pipeline import PathState
from workflows.spec import TrialSpec
from workflows.verdict import judge, verdict_line

REPORT_VERSION = 1


def finite(value: Any) -> Any:
    """JSON has no NaN or Infinity: such floats become null (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _placement(states: dict[str, PathState]) -> dict[str, list[str]]:
    hosts: dict[str, list[str]] = {}
    for name, state in states.items():
        hosts.setdefault(state.host or "unknown", []).append(name)
    return hosts


def build_report(
    spec: TrialSpec,
    spec_json: dict[str, Any],
    trial_id: str,
    run_id: str,
    started: datetime,
    ended: datetime,
    states: dict[str, PathState],
    cancel_reason: str,
) -> dict[str, Any]:
    reference = dataclasses.asdict(states[spec.reference])
    verdicts: dict[str, Any] = {}
    for p in spec.candidates:
        candidate = dataclasses.asdict(states[p.name])
        if cancel_reason and candidate["status"] != "done":
            criteria = {
                "trial": {
                    "result": "inconclusive",
                    "reason": f"cancelled: {cancel_reason}",
                    "figure": "cancelled",
                }
            }
            verdicts[p.name] = {
                "verdict": "INCONCLUSIVE",
                "criteria": criteria,
                "line": verdict_line("INCONCLUSIVE", criteria),
            }
            continue
        verdicts[p.name] = judge(reference, candidate, spec.policy, spec.training is not None)
    paths = {name: dataclasses.asdict(state) for name, state in states.items()}
    for state in paths.values():
        state["compatibility"] = findings(state)  # what the report's compatibility section shows
    report: dict[str, Any] = finite(
        {
            "report_version": REPORT_VERSION,
            "trial_id": trial_id,
            "run_id": run_id,
            "status": "cancelled" if cancel_reason else "completed",
            "cancel_reason": cancel_reason,
            "description": spec.description,
            "model": dataclasses.asdict(spec.model),
            "started": started.isoformat(),
            "ended": ended.isoformat(),
            "duration_s": (ended - started).total_seconds(),
            "reference": spec.reference,
            "inputs": {
                "seed": spec.inputs.seed,
                "tensors": [dataclasses.asdict(t) for t in spec.inputs.tensors],
                "file": spec.inputs.file,
                "file_sha256": spec.inputs.file_sha256,
                "workload": spec.inputs.workload,
                "workload_sha256": spec.inputs.workload_sha256,
                # request count, shapes and sizes of the replayed workload (from the reference run)
                "workload_distribution": states[spec.reference].correctness.get("workload", {})
                if spec.inputs.workload and spec.reference in states
                else {},
            },
            "configuration": {
                "paths": [dataclasses.asdict(p) for p in spec.paths],
                "performance": dataclasses.asdict(spec.performance),
                "training": dataclasses.asdict(spec.training) if spec.training else None,
                "criteria": dataclasses.asdict(spec.criteria),
                "policy": dataclasses.asdict(spec.policy),
            },
            "placement": _placement(states),
            "paths": paths,
            "verdicts": verdicts,
            "spec": spec_json,
        }
    )
    return report
