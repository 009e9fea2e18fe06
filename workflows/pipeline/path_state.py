"""What a trial knows about one path, typed: the activities' results as they arrived, the errors
and the bookkeeping of its reservation and serving set-up.

The workflow keeps a `PathState` per path, its kind's `judge` reads it, and `to_json` gives the
path's entry of the report in the report's JSON shape (docs/trial-spec.md#what-the-trial-writes): a phase
that did not run is `{}`, a skipped one `{"skipped": why}`, so readers of stored reports see
the same keys as before the state was typed. Pure: it runs inside the workflow sandbox.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from workflows.generation.types import GenerationCompareResult, GenerationPerformanceResult
from workflows.pipeline.types import (
    CorrectnessResult,
    EconomicsResult,
    InputsCompatibility,
    PathInfo,
    PerformanceResult,
    PrepareResult,
    ServingConfig,
    TrainResult,
)


def _json(value: Any) -> dict[str, Any]:
    return dataclasses.asdict(value) if value is not None else {}


@dataclass
class PathState:
    """Everything the report says about one path."""

    path: str
    role: str  # reference | candidate
    host: str = ""
    phase: str = "pending"
    status: str = "pending"  # pending | running | done | failed | cancelled
    phases_done: int = 0
    info: PathInfo | None = None
    prepare: PrepareResult | None = None
    # the reference's is its own marker (passed, no outputs): it is what candidates compare with
    correctness: CorrectnessResult | None = None
    golden: bool = False  # the reference had a float64 golden run
    against_float64: CorrectnessResult | None = None  # the reference's own error against float64
    workload: dict[str, Any] = field(default_factory=dict)  # a replayed workload's distribution
    # the counters around the fixed inputs' requests: fallback calls per request, compilations
    compatibility_on_inputs: InputsCompatibility | None = None
    performance: PerformanceResult | None = None
    performance_skipped: str = ""
    training: TrainResult | None = None
    training_skipped: str = ""
    economics: EconomicsResult | None = None
    economics_unpriced: bool = False  # no reservation could be held: `ledger_problem` says why
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ledger_problem: str = ""
    reservation_id: str = ""
    reservation_open: bool = False
    reservation_start_us: int = 0  # set when the reservation is asked for, before its answer
    loaded: bool = False
    restore: ServingConfig | None = None  # serving config before the trial; None = unload after
    timeline: dict[str, list[str]] = field(default_factory=dict)  # phase -> [start, end] (ISO)
    # a generation trial (docs/trial-spec.md#generation): the divergence rule's verdict (the
    # reference's is its own run against its float64 run), and the generation scenario
    generation: GenerationCompareResult | None = None
    generation_performance: GenerationPerformanceResult | None = None

    @property
    def is_reference(self) -> bool:
        return self.role == "reference"

    def fail(self, phase: str, reason: str) -> None:
        """The path failed in `phase`: its measurement ends there, for `reason`."""
        self.errors[phase] = reason
        self.status = "failed"

    def summary(self) -> dict[str, Any]:
        return {"phase": self.phase, "status": self.status, "host": self.host, "errors": self.errors}

    def to_json(self, results: dict[str, Any]) -> dict[str, Any]:
        """The path's entry in the report (the shape stored reports have); `results` holds its
        kind's `correctness` and `performance` entries (TrialKind.results_json)."""
        return {
            "path": self.path,
            "role": self.role,
            "host": self.host,
            "phase": self.phase,
            "status": self.status,
            "phases_done": self.phases_done,
            "info": _json(self.info),
            "prepare": _json(self.prepare),
            "correctness": results["correctness"],
            "compatibility_on_inputs": self.compatibility_on_inputs.to_json()
            if self.compatibility_on_inputs
            else {},
            "performance": {"skipped": self.performance_skipped}
            if self.performance_skipped
            else results["performance"],
            "training": {"skipped": self.training_skipped}
            if self.training_skipped
            else (self.training.to_json() if self.training else {}),
            "economics": self._economics_json(),
            "errors": dict(self.errors),
            "notes": list(self.notes),
            "ledger_problem": self.ledger_problem,
            "reservation_id": self.reservation_id,
            "reservation_open": self.reservation_open,
            "loaded": self.loaded,
            "restore": _json(self.restore),
            "timeline": {phase: list(span) for phase, span in self.timeline.items()},
        }

    def _economics_json(self) -> dict[str, Any]:
        if self.economics_unpriced:
            return {"unpriced": True, "problem": self.ledger_problem}
        return _json(self.economics)
