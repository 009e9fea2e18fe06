"""The compatibility criterion: what a path needed to run the model, judged by the policy.

Findings come from two places of a path's state: the prepare phase (LoadModel's report of the
load and warm-up: fallback ops, graph breaks, recompiles, unsupported dtypes, adaptations) and
the correctness phase, whose requests on the trial's fixed inputs are bracketed by the
executor's counters, so host-fallback ops have a call count per request and a compilation on
the trial's own inputs (a shape that depends on the data, or one not warmed) is seen. The
policy caps the number of distinct host-fallback ops and of graph breaks; beyond a cap the
criterion fails (REJECT) or warns, as `policy.compatibility_action` says. Pure: it runs inside
the workflow when the report is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workflows.pipeline.path_state import PathState
from workflows.report.results import FAIL, PASS, UNKNOWN, WARN
from workflows.spec.trial_io import Criterion
from workflows.spec.trial_spec import Policy


@dataclass
class FallbackFinding:
    op: str
    calls_per_request: float
    calls_at_load: int


@dataclass
class Findings:
    """One path's compatibility findings, in the report's shape (its `compatibility` entry)."""

    known: bool
    requests: int
    per_request_unknown: str
    fallback_ops: list[FallbackFinding] = field(default_factory=list)
    graph_breaks: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)
    recompiles_at_load: int = 0
    compilations_on_inputs: int = 0
    unsupported_dtypes: list[str] = field(default_factory=list)
    adaptations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def findings(state: PathState) -> Findings:
    """One path's compatibility findings: the load's report and the fixed inputs' counters."""
    load = state.prepare.compatibility if state.prepare else None
    inputs = state.compatibility_on_inputs
    per_request = inputs.fallback_ops_per_request if inputs else {}
    at_load = load.fallback_ops if load else {}
    unknown = "the fixed inputs did not run" if inputs is None else inputs.unknown
    found = Findings(
        known=load is not None,
        requests=inputs.requests if inputs else 0,
        per_request_unknown=unknown,
        fallback_ops=[
            FallbackFinding(op, per_request.get(op, 0.0), at_load.get(op, 0))
            for op in sorted(set(at_load) | set(per_request))
        ],
        compilations_on_inputs=inputs.compilations if inputs else 0,
    )
    if load is not None:
        found.graph_breaks = load.graph_breaks
        found.graph_break_reasons = list(load.graph_break_reasons)
        found.recompiles_at_load = load.recompiles
        found.unsupported_dtypes = list(load.unsupported_dtypes)
        found.adaptations = list(load.adaptations)
        found.notes = list(load.notes)
    return found


def _op_text(op: FallbackFinding) -> str:
    per = op.calls_per_request
    if per:
        return f"{op.op} {per:g} call{'s' if per != 1 else ''} per request"
    return f"{op.op} ({op.calls_at_load} calls during load and warm-up, none on the inputs)"


def fallback_summary(found: Findings) -> str:
    """The host-fallback ops that ran on the trial's inputs, for the latency reason ("" if none)."""
    return ", ".join(_op_text(op) for op in found.fallback_ops if op.calls_per_request)


def _reason(found: Findings) -> list[str]:
    ops, recompiled = found.fallback_ops, found.compilations_on_inputs
    reasons = "; ".join(found.graph_break_reasons)
    parts = [
        "host fallback: " + ("; ".join(_op_text(op) for op in ops) if ops else "none"),
        f"graph breaks: {found.graph_breaks}" + (f" ({reasons})" if reasons else ""),
        f"recompiles: {found.recompiles_at_load} at load, {recompiled} on the trial's inputs after warm-up"
        + (" (a shape that depends on the data, or one not warmed)" if recompiled else ""),
        "unsupported dtypes: " + (", ".join(found.unsupported_dtypes) or "none"),
        "adaptations: " + ("; ".join(found.adaptations) or "none"),
    ]
    if found.per_request_unknown:
        parts.append(f"calls per request unknown: {found.per_request_unknown}")
    return parts


def _figure(found: Findings) -> str:
    ops, breaks, recompiled = found.fallback_ops, found.graph_breaks, found.compilations_on_inputs
    if ops:
        figure = f"{len(ops)} host-fallback op{'s' if len(ops) != 1 else ''}: " + ", ".join(
            f"{op.op} {op.calls_per_request:g}/request" for op in ops
        )
    else:
        figure = "0 host-fallback ops"
    figure += f", {breaks} graph break{'s' if breaks != 1 else ''}"
    if recompiled:
        figure += f", {recompiled} recompile{'s' if recompiled != 1 else ''} on the inputs"
    return figure


def judge_compatibility(state: PathState, policy: Policy) -> Criterion:
    """The compatibility criterion of one candidate: result, reason and its decisive figure."""
    found = findings(state)
    if not found.known:
        why = state.errors.get("prepare") or "the path did not finish its prepare phase"
        return Criterion(UNKNOWN, f"no findings: {why}", "no findings")
    parts = _reason(found)
    over = []
    if len(found.fallback_ops) > policy.max_fallback_ops:
        over.append(f"{len(found.fallback_ops)} host-fallback op(s), policy allows {policy.max_fallback_ops}")
    if found.graph_breaks > policy.max_graph_breaks:
        over.append(f"{found.graph_breaks} graph break(s), policy allows {policy.max_graph_breaks}")
    if over:
        result = FAIL if policy.compatibility_action == "reject" else WARN
        parts.append(f"{'; '.join(over)}: {policy.compatibility_action}")
    elif found.compilations_on_inputs:
        result = WARN
    else:
        result = PASS
    return Criterion(result, "; ".join(parts), _figure(found))
