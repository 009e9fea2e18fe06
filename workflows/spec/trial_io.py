"""TrialWorkflow's own input and output, typed: `TrialInput` (the spec object as sent) and
`TrialReport` (whose JSON form is the report), with the data converter that keeps what the
Temporal UI sends intact.

The input stays the documented JSON object (docs/trial-spec.md): each top-level key is a field,
typed `Any` so that Temporal's converter never refuses a value before the spec parser
(workflows/spec/trial_spec.py) has named the field and said what to send. Temporal's dataclass
conversion drops keys it does not know, but a misspelt key must be an error, not a silent
default; `TrialPayloadConverter` (installed on the worker by workflows/worker.py) therefore
keeps unknown top-level keys in `TrialInput.unknown`, where the parser sees and names them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
    JSONTypeConverter,
)

from workflows.report.results import Adoption, Result, adoption
from workflows.spec.trial_spec import Criteria, ModelRef, PathSpec, PerformancePlan, Policy, TrainingPlan


def finite(value: Any) -> Any:
    """Plain JSON: NaN and Infinity become null, tuples lists (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


@dataclass
class TrialInput:
    """The trial spec as sent (None = the key was absent, as the spec parser treats null)."""

    model: Any = None
    inputs: Any = None
    paths: Any = None
    reference: Any = None
    criteria: Any = None
    performance: Any = None
    training: Any = None
    policy: Any = None
    timeouts: Any = None
    team: Any = None
    description: Any = None
    unknown: dict[str, Any] = field(default_factory=dict)  # keys the spec does not define

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrialInput:
        documented = {f.name for f in dataclasses.fields(cls)} - {"unknown"}
        unknown = dict(data.get("unknown") or {}) if isinstance(data.get("unknown"), dict) else {}
        unknown.update({k: v for k, v in data.items() if k not in documented and k != "unknown"})
        return cls(**{k: v for k, v in data.items() if k in documented}, unknown=unknown)

    def to_json(self) -> dict[str, Any]:
        """The spec object: what the parser validates and the report stores."""
        sent = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "unknown"}
        return {**{k: v for k, v in sent.items() if v is not None}, **self.unknown}


class _TrialInputConverter(JSONTypeConverter):
    def to_typed_value(self, hint: type, value: Any) -> Any:
        if hint is TrialInput and isinstance(value, Mapping):
            return TrialInput.from_json(value)
        return JSONTypeConverter.Unhandled


class TrialPayloadConverter(CompositePayloadConverter):
    """Temporal's default payload converters, with TrialInput read from the raw JSON object."""

    def __init__(self) -> None:
        json_converter = JSONPlainPayloadConverter(custom_type_converters=[_TrialInputConverter()])
        super().__init__(
            *(
                json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


TRIAL_CONVERTER = dataclasses.replace(DataConverter.default, payload_converter_class=TrialPayloadConverter)


@dataclass
class Criterion:
    result: Result
    reason: str
    figure: str = ""  # the one decisive figure, for the verdict line


@dataclass
class Verdict:
    verdict: Adoption
    criteria: dict[str, Criterion]
    line: str  # the verdict readable alone

    @classmethod
    def of(cls, criteria: dict[str, Criterion]) -> Verdict:
        """The verdict of a path's criteria: any failure REJECTs, then any undecided criterion
        makes it INCONCLUSIVE; a warning leaves it as it is."""
        verdict = adoption([c.result for c in criteria.values()])
        return cls(verdict, criteria, verdict_line(verdict, criteria))


def verdict_line(verdict: str, criteria: dict[str, Criterion]) -> str:
    """The verdict readable alone: each criterion's result with its one decisive figure."""
    parts = [f"{name} {c.result}" + (f" ({c.figure})" if c.figure else "") for name, c in criteria.items()]
    return f"{verdict}: " + "; ".join(parts)


@dataclass
class TrialConfiguration:
    paths: list[PathSpec]
    performance: PerformancePlan
    training: TrainingPlan | None
    criteria: Criteria
    policy: Policy


@dataclass
class TrialReport:
    """The trial's result; `to_json()` is the report (docs/trial-spec.md#what-the-trial-writes)."""

    report_version: int
    trial_id: str
    run_id: str
    status: str  # completed | cancelled
    cancel_reason: str
    description: str
    model: ModelRef
    started: str  # ISO 8601
    ended: str
    duration_s: float
    reference: str
    inputs: dict[str, Any]
    configuration: TrialConfiguration
    placement: dict[str, list[str]]  # host -> paths that shared it
    artifacts: dict[str, Any]  # the artifact sha256 each path loaded, and whether they agree
    paths: dict[str, dict[str, Any]]  # PathState.to_json() plus the compatibility findings
    verdicts: dict[str, Verdict]
    spec: dict[str, Any]  # the spec as sent
    notes: list[str] = field(default_factory=list)
    # tensor | generation | training (workflows/kinds.py); "" in results stored before it existed
    kind: str = ""

    def to_json(self) -> dict[str, Any]:
        report: dict[str, Any] = finite(dataclasses.asdict(self))
        return report

    def verdict_keywords(self) -> dict[str, str]:
        return {path: v.verdict for path, v in self.verdicts.items()}
