"""The trial report as data: built in the workflow (pure, deterministic), stored in the ledger
as JSON, rendered to Markdown and HTML by workflows/report/render.py.

It carries what docs/architecture.md#trials asks of every figure: the system each path ran on
(device, versions,
host and which paths shared it), input sizes and seeds, configuration, and the comparison
basis, next to the verdict per path with the reason per criterion.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from workflows.kinds import kind_of
from workflows.pipeline.compatibility import findings
from workflows.pipeline.path_state import PathState
from workflows.report.results import Adoption, Result
from workflows.spec.trial_io import Criterion, TrialConfiguration, TrialReport, Verdict, finite, verdict_line
from workflows.spec.trial_spec import TrialSpec

REPORT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TrialRun:
    """What the workflow knows when it writes the report."""

    spec: TrialSpec
    spec_json: dict[str, object]
    trial_id: str
    run_id: str
    started: datetime
    ended: datetime
    cancel_reason: str = ""


def _placement(states: dict[str, PathState]) -> dict[str, list[str]]:
    hosts: dict[str, list[str]] = {}
    for name, state in states.items():
        hosts.setdefault(state.host or "unknown", []).append(name)
    return hosts


def artifacts(spec: TrialSpec, states: dict[str, PathState]) -> dict[str, object]:
    """The artifact sha256 each path loaded, and whether paths of one model version agree."""
    per_path: dict[str, dict[str, str]] = {}
    for p in spec.paths:
        prepared = states[p.name].prepare if p.name in states else None
        per_path[p.name] = {
            "model": spec.model.name,
            "version": p.version or spec.model.version,
            "sha256": prepared.checkpoint_sha256 if prepared else "",
        }
    hashes: dict[str, set[str]] = {}
    for entry in per_path.values():
        if entry["sha256"]:
            hashes.setdefault(entry["version"], set()).add(entry["sha256"])
    return {"paths": per_path, "consistent": all(len(h) == 1 for h in hashes.values())}


def _cancelled(reason: str) -> Verdict:
    criteria = {"trial": Criterion(Result.INCONCLUSIVE, f"cancelled: {reason}", "cancelled")}
    return Verdict(Adoption.INCONCLUSIVE, criteria, verdict_line(Adoption.INCONCLUSIVE, criteria))


def build_report(run: TrialRun, states: dict[str, PathState]) -> TrialReport:
    spec = run.spec
    kind = kind_of(spec)
    reference = states[spec.reference]
    verdicts: dict[str, Verdict] = {}
    for p in spec.candidates:
        candidate = states[p.name]
        if run.cancel_reason and candidate.status != "done":
            verdicts[p.name] = _cancelled(run.cancel_reason)
        else:
            verdicts[p.name] = kind.judge(reference, candidate, spec.policy)
    paths = {}
    for name, state in states.items():
        # what the report's compatibility section shows
        entry = state.to_json(kind.results_json(state))
        paths[name] = finite({**entry, "compatibility": dataclasses.asdict(findings(state))})
    inputs = spec.inputs
    return TrialReport(
        report_version=REPORT_VERSION,
        kind=kind.name,
        trial_id=run.trial_id,
        run_id=run.run_id,
        status="cancelled" if run.cancel_reason else "completed",
        cancel_reason=run.cancel_reason,
        description=spec.description,
        model=spec.model,
        started=run.started.isoformat(),
        ended=run.ended.isoformat(),
        duration_s=(run.ended - run.started).total_seconds(),
        reference=spec.reference,
        inputs=finite(
            {
                "seed": inputs.seed,
                "tensors": [dataclasses.asdict(t) for t in inputs.tensors],
                "file": inputs.file,
                "file_sha256": inputs.file_sha256,
                "workload": inputs.workload,
                "workload_sha256": inputs.workload_sha256,
                "prompts": dataclasses.asdict(inputs.prompts) if inputs.prompts else None,
                # request count, shapes and sizes of the replayed workload (from the reference run)
                "workload_distribution": reference.workload if inputs.workload else {},
            }
        ),
        configuration=TrialConfiguration(
            list(spec.paths), spec.performance, spec.training, spec.criteria, spec.policy
        ),
        placement=_placement(states),
        artifacts=artifacts(spec, states),
        paths=paths,
        verdicts=verdicts,
        spec=finite(run.spec_json),
    )
