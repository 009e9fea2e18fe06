"""A trial kind as a strategy: what one kind of trial (tensor, generation, training) does in each
step of a path's pipeline, how it judges a candidate, and how its report sections read.

`PathRun` (workflows/pipeline/path_run.py) does what every kind shares (describe, reserve,
load, prepare, the phases' timeline, economics, cleanup) and calls a `PathSteps` for the rest,
in order: `prepare` (before the path loads: the reference's float64 run), `correctness`,
`performance`, `training`, and `release` when the path ends however it ends. A `TrialKind`
makes a path's steps, judges a candidate against the reference (`judge`), gives the path's
results in the report's shape (`results_json`) and renders its sections (`render`). No code
outside a kind's own package asks which kind it has; workflows/kinds.py is the one place that
chooses one, from the spec.

The steps run in the workflow sandbox: they only schedule activities and await events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

if TYPE_CHECKING:
    from workflows.pipeline.context import TrialContext
    from workflows.pipeline.interleave import Measurer
    from workflows.pipeline.path_ledger import PathLedger
    from workflows.pipeline.path_state import PathState
    from workflows.pipeline.types import Target
    from workflows.spec.trial_io import Verdict
    from workflows.spec.trial_spec import Policy

T = TypeVar("T")
Rows = list[tuple[str, dict[str, Any]]]  # (path, its entry of the report), the reference first


class Measurement(Protocol):
    """How a path's measurement runs: alone, or in alternating blocks with the paths that share
    its host (workflows/pipeline/interleave.py); `how` is the kind's activities for either."""

    async def measure(self, name: str, request: Any, how: Measurer[Any, T]) -> T: ...


class PathSteps(Protocol):
    """One path's kind-specific steps; `reference` is the reference path's steps of the same kind."""

    async def prepare(self) -> None:
        """Before the path is prepared: the reference's golden (float64) run, if the kind has one."""

    async def correctness(self, reference: Self) -> bool:
        """Run the fixed inputs and judge them against the reference; False: no speed verdict."""

    async def performance(self, reference: Self, measurement: Measurement) -> None:
        """Measure the path (only called when its correctness passed), through `measurement`
        where the kind's measurement can alternate with other paths'."""

    async def training(self, reference: Self, passed: bool) -> None:
        """Train the path, if the kind trains."""

    def release(self) -> None:
        """The path is over (done, failed or skipped): wake every path waiting on its results."""


class KindRender(Protocol):
    """A kind's sections of the Markdown report, read from the stored report (JSON)."""

    def inputs(self, inputs: dict[str, Any]) -> str:
        """The trial's inputs in one phrase."""

    def correctness(self, corr: dict[str, Any]) -> list[str]: ...

    def performance(self, perf: dict[str, Any]) -> list[str]:
        """The measurement's lines, each with its sizes and load (not skipped, not empty)."""

    def training(self, training: dict[str, Any]) -> list[str]: ...

    def cost(self, state: dict[str, Any]) -> list[str]:
        """Cost lines beyond the cost per completed job every kind shows."""

    def appendix(self, rows: Rows) -> list[str]:
        """Sections after the paths (e.g. the metrics' definitions)."""

    def charts(self, rows: Rows) -> list[str]:
        """The kind's charts (inline SVG), before the cost and preparation charts."""


class TrialKind(Protocol):
    name: str  # as the report's `kind` says it
    render: KindRender

    def steps(self, ctx: TrialContext, target: Target, state: PathState, ledger: PathLedger) -> PathSteps: ...

    def judge(self, reference: PathState, candidate: PathState, policy: Policy) -> Verdict:
        """The verdict of one candidate against the reference, with the reason per criterion."""

    def results_json(self, state: PathState) -> dict[str, Any]:
        """The path's `correctness` and `performance` entries of the report (stored reports' shape)."""
