"""The trial in the main job: `tiny-lm` on cpu-eager (reference) versus xla, on Temporal.

The spec is the same JSON an operator pastes into the Temporal UI's Start Workflow form
(docs/trial-spec.md); it runs on the cluster's trial worker, and the report the workflow
stores in the ledger is read back and written as HTML and JSON with the trial tools' renderer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clients.local_cluster import traffic

if TYPE_CHECKING:
    from workflows.temporal_link import TemporalLink

POLL_S = 2.0


@dataclass
class TrialOutcome:
    trial_id: str
    status: str
    verdicts: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    reports: dict[str, Path] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def demo_spec(team: str) -> dict[str, Any]:
    """A small trial that still answers the four questions: correctness on fixed inputs,
    adaptations, warm latency at batch 1 and 4, and cost per completed job, in minutes."""
    return {
        "description": "switchyard demo: is the XLA path a fit for tiny-lm on this machine?",
        "model": {"name": "tiny-lm"},
        "inputs": {
            "seed": 7,
            # The sequence length executors warm tiny-lm up with (its DEFAULT_SEQ, 32): XLA
            # compiles per shape, and any other length would compile while being measured.
            "tensors": [
                {
                    "name": "input_ids",
                    "datatype": "INT64",
                    "shape": [2, traffic.DEFAULT_SEQ],
                    "low": 0,
                    "high": 64,
                }
            ],
        },
        "paths": [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager", "precision": "fp32"},
            {"name": "xla", "executor": "xla", "mode": "lazy", "precision": "fp32"},
        ],
        "reference": "cpu-eager",
        "criteria": {"logits": True, "top_k": 5},
        "performance": {
            "warmup": 3,
            "min_iterations": 20,
            "min_seconds": 1.0,
            "scenarios": ["single-stream", "offline"],
            "batch_sizes": [1, 4],
            "offline_concurrency": 2,
            # Offline requests may be batched together (2 x 4): warm every bucket up to 8 so
            # the XLA path never compiles while it is measured.
            "batch_buckets": [1, 2, 4, 8],
        },
        "policy": {"min_cost_saving": 0.0, "max_p95_regression": 0.1},
        "team": team,
    }


def reasons_of(verdict: Mapping[str, Any]) -> list[str]:
    from workflows.report.render import criteria_in_order

    return [f"{name}: {c['result']}: {c['reason']}" for name, c in criteria_in_order(dict(verdict))]


async def run_trial(
    link: TemporalLink,
    task_queue: str,
    out_dir: Path,
    trial_id: str,
    spec: dict[str, Any],
    tell: Callable[[str], None] = print,
    metering: str = "",
    api_key: str = "",
) -> TrialOutcome:
    """Starts TrialWorkflow with `spec` (its grant from `metering`, asked with `api_key`:
    workflows/activities/authorization.py), reports progress now and then, returns the verdicts."""
    from temporalio.service import RPCError

    from workflows.activities.authorization import GRANT_MEMO, request_grant
    from workflows.report.render import render
    from workflows.spec.trial_io import TrialInput
    from workflows.spec.trial_spec import parse_spec
    from workflows.trial import TrialWorkflow
    from workflows.worker import connect

    parsed = parse_spec(spec)  # a bad spec fails here, naming the field, before anything starts
    grant = await request_grant(metering, parsed, trial_id, api_key) if metering else ""
    client = await connect(link)  # TLS where set, the payload codec (workflows/temporal_link.py)
    handle = await client.start_workflow(
        TrialWorkflow.run,
        TrialInput.from_json(spec),
        id=trial_id,
        task_queue=task_queue,
        memo={GRANT_MEMO: grant} if grant else None,
    )
    result = asyncio.ensure_future(handle.result())
    last = ""
    while not result.done():
        await asyncio.wait({result}, timeout=POLL_S)
        if result.done():
            break
        try:
            progress = await handle.query(TrialWorkflow.progress)
        except RPCError:
            continue  # not picked up by the worker yet
        phases = ", ".join(f"{n} {p['phase']}/{p['status']}" for n, p in progress.get("paths", {}).items())
        line = f"  trial {progress.get('percent', 0):5.1f}%  {phases}"
        if line != last:
            tell(line)
            last = line
    report = result.result().to_json()
    outcome = TrialOutcome(trial_id, str(report.get("status", "")), report=report)
    for path, verdict in report.get("verdicts", {}).items():
        outcome.verdicts[path] = str(verdict.get("verdict", ""))
        outcome.reasons[path] = reasons_of(verdict)
    outcome.reports["trial"] = await asyncio.to_thread(
        _write, out_dir / f"{trial_id}.html", render(report, "html")
    )
    outcome.reports["trial (json)"] = await asyncio.to_thread(
        _write, out_dir / f"{trial_id}.json", json.dumps(report, indent=2)
    )
    return outcome


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
