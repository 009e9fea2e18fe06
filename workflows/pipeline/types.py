"""Activity inputs and outputs: one dataclass in, one out (docs/architecture.md#code-style), JSON-friendly.

Tensors travel as base64 text (Temporal's JSON converter has no bytes inside objects) and
money as integer micro-units (it has no Decimal). The workflow keeps these in its state, so
they are plain data with no behaviour beyond small helpers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from workflows.spec.trial_spec import Criteria, InputTensor, PerformancePlan, TrainingPlan

TASK_QUEUE = "switchyard-trials"
PHASES = ("prepare", "correctness", "performance", "training", "economics")


@dataclass
class Target:
    """Where and what one path runs; every path activity gets one."""

    trial_id: str
    path: str
    executor: str
    model: str
    version: str
    checkpoint_sha256: str
    mode: str
    precision: str
    batch_buckets: list[int]
    ledger_path: str = ""  # the path's id in the ledger, "<name>@<host>"
    team: str = ""


@dataclass
class PathInfo:
    path: str
    address: str
    host: str
    backend: str
    device_name: str
    device_count: int
    memory_total_bytes: int
    resource_class: str
    price_key: str
    torch_version: str
    versions: dict[str, str]
    ledger_path: str
    registered_models: list[str] = field(default_factory=list)  # "name:version" it can load

    def model_problem(self, target: Target, where: str) -> str:
        """Why `target`'s model cannot load on this path ("" if it can, or the executor does not
        say what it holds); `where` names the spec field to fix."""
        if not self.registered_models:
            return ""
        entries = [entry.partition(":") for entry in self.registered_models]
        versions = sorted(v for n, _, v in entries if n == target.model)
        if not versions:
            names = ", ".join(sorted({n for n, _, _ in entries}))
            return (
                f"NOT_FOUND: model {target.model!r} is not in the model repository of {target.executor} "
                f"(it holds {names}); fix model.name or add the model (`switchyard models add`)"
            )
        if target.version and target.version not in versions:
            return (
                f"NOT_FOUND: model {target.model} has no version {target.version!r} on {target.executor} "
                f"(it has {', '.join(versions)}); fix {where}"
            )
        return ""


@dataclass
class TensorData:
    name: str
    datatype: str
    shape: list[int]
    data_b64: str


@dataclass
class InputsPlan:
    """The spec's inputs as the activities need them (seeded generator or a checked file)."""

    seed: int
    tensors: list[InputTensor]
    file: str = ""
    file_sha256: str = ""
    workload: str = ""  # a captured workload's id (services/router/capture.py), replayed in order
    workload_sha256: str = ""


@dataclass
class ReservationRequest:
    target: Target
    start_unix_us: int = 0


@dataclass
class ReservationResult:
    reservation_id: str
    start_unix_us: int


@dataclass
class RunRequest:
    """Run the fixed inputs through a path `repeats` times (golden: load fp64 first)."""

    target: Target
    inputs: InputsPlan
    repeats: int = 1
    golden: bool = False


@dataclass
class InputsCompatibility:
    """What a path's counters showed around the fixed inputs' requests (ModelStatus before and
    after): host-fallback calls in all and per request, compilations after warm-up."""

    requests: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_ops_per_request: dict[str, float] = field(default_factory=dict)
    compilations: int = 0
    unknown: str = ""  # why the counters could not be read ("" = they were)

    def to_json(self) -> dict[str, Any]:
        if self.unknown:
            return {"unknown": self.unknown}
        return {
            "requests": self.requests,
            "fallback_ops": self.fallback_ops,
            "fallback_ops_per_request": self.fallback_ops_per_request,
            "compilations": self.compilations,
        }


@dataclass
class RunResult:
    runs: list[list[TensorData]]
    busy_us: int
    started_unix_us: int
    ended_unix_us: int
    workload: dict[str, Any] = field(default_factory=dict)  # a replayed workload's distribution
    compatibility: InputsCompatibility | None = None  # None: not measured (the golden run)


@dataclass
class LoadCompatibility:
    """LoadModel's compatibility report (executor.proto CompatibilityReport), as the report shows it."""

    fallback_ops: dict[str, int] = field(default_factory=dict)
    graph_breaks: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)
    recompiles: int = 0
    unsupported_dtypes: list[str] = field(default_factory=list)
    adaptations: list[str] = field(default_factory=list)
    compilations: int = 0
    cached_compilations: int = 0  # graphs found in the compile cache instead (XLA's CachedCompile)
    compile_time_s: float = 0.0
    compilations_after_warmup: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class ServingConfig:
    """How an executor serves a model (LoadModelRequest fields), to put back after the trial."""

    model_name: str
    version: str
    mode: str
    precision: str
    batch_buckets: list[int]
    dynamic_batching: bool
    max_queue_delay_us: int
    max_queue_size: int
    checkpoint_sha256: str


@dataclass
class Registration:
    """The path's registration in the ledger: "" when registered, else why its cost is unknown."""

    problem: str = ""


@dataclass
class PrepareResult:
    checkpoint_load_s: float
    to_device_s: float
    compile_s: float
    total_s: float
    checkpoint_sha256: str
    compatibility: LoadCompatibility
    state: str
    started_unix_us: int = 0
    ended_unix_us: int = 0


@dataclass
class CompareRequest:
    target: Target
    criteria: Criteria
    reference: list[TensorData]
    candidate: list[TensorData]
    golden: list[TensorData] = field(default_factory=list)
    reference_repeat: list[TensorData] = field(default_factory=list)
    candidate_repeat: list[TensorData] = field(default_factory=list)


@dataclass
class OutputVerdict:
    output: str
    passed: bool
    metrics: dict[str, Any]
    reasons: list[str]
    justification: str
    finding: str = ""  # "non-deterministic" | "wrong but stable" | "wrong" | ""


@dataclass
class CorrectnessResult:
    passed: bool
    outputs: list[OutputVerdict]


@dataclass
class PerformanceRequest:
    target: Target
    inputs: InputsPlan
    plan: PerformancePlan
    met_quality: bool
    ledger: bool = True  # false when the path could not be registered (no price key)
    # the reference's answer per batch size (key str(batch)) for the candidate to check its
    # answers under load against (workflows/tensor/under_load.py); empty for the reference itself
    reference_answers: dict[str, list[TensorData]] = field(default_factory=dict)
    criteria: Criteria | None = None  # the correctness criteria; None: keep answers, check none
    under_load_skip: str = ""  # why the answers under load are not checked ("" = they are)


@dataclass
class ExtensionRule:
    """How far an interleaved measurement may extend its single-stream scenario while a
    latency interval straddles its bound (workflows/tensor/extension.py)."""

    reference: str  # the path whose blocks every other path's pair with
    max_extra_requests: int  # per path
    max_p95_regression: float
    confidence: float


@dataclass
class Extension:
    """What the extension of a single-stream scenario measured, and why it stopped."""

    budget: int = 0  # extra requests per path the plan allowed
    extra_requests: int = 0  # measured per path after the planned blocks
    extra_blocks: int = 0  # paired blocks added (each path's)
    rounds: int = 0
    level: float = 0.0  # the confidence of the last look: the verdict's (stricter once extended)
    stopped: str = ""  # "decided", "budget", "on the bound", "no interval"
    before: dict[str, str] = field(default_factory=dict)  # path -> its interval at the plan's end
    text: str = ""  # the sentence the verdict quotes


@dataclass
class InterleavedRequest:
    """Paths that share a host, measured together in alternating blocks; one plan for all."""

    paths: list[PerformanceRequest]
    extension: ExtensionRule | None = None  # None: the planned blocks only


@dataclass
class ScenarioResult:
    scenario: str
    batch_size: int
    concurrency: int
    iterations: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    compute_p50_ms: float
    throughput: float
    throughput_unit: str
    input_sizes: dict[str, list[int]]
    histogram_ms: list[float]  # bucket edges, then counts follow in `histogram_counts`
    histogram_counts: list[int]
    failed: int = 0
    # requests that stalled (answered after at least STALL_MIN_S and STALL_FACTOR x the median:
    # an executor that stopped answering for a while), and the longest of them, in ms
    stalled: int = 0
    longest_stall_ms: float = 0.0
    # the completed requests' latencies in ms, in blocks of consecutive requests, in the order
    # measured: the verdict bootstraps its intervals over them (workflows/tensor/intervals.py)
    blocks_ms: list[list[float]] = field(default_factory=list)
    extension: Extension | None = None  # single-stream measured in alternation: its extension


@dataclass
class PerformanceResult:
    scenarios: list[ScenarioResult]
    compilations_before: int
    compilations_after: int
    busy_us: int
    jobs: int
    ok: bool
    problem: str = ""
    memory_total_bytes: int = 0
    memory_min_available_bytes: int = 0  # device-wide; total - this = peak use while measuring
    answers: dict[str, list[TensorData]] = field(default_factory=dict)  # first answer per batch
    under_load: UnderLoad | None = None  # the candidate's answers under load, checked
    # the paths measured in alternating blocks with this one (workflows/tensor/performance.py), and
    # why a path that shares the reference's host was not ("" = it was, or no shared host)
    interleaved_with: list[str] = field(default_factory=list)
    not_interleaved: str = ""
    # the path's executor's process memory sampled through the measurement: one row per
    # sampling interval of its own blocks, [requests served, rss bytes grown, device bytes
    # grown] (workflows/tensor/growth.py fits their slope); the device column counts only
    # where the executor reports its device allocation
    memory_steps: list[list[int]] = field(default_factory=list)
    memory_device_reported: bool = False


@dataclass
class InterleavedResult:
    results: list[PerformanceResult]  # in the order of the request's paths


@dataclass
class UnderLoad:
    """A seeded share of a candidate's answers under load against the reference's answers to
    the same inputs, by the correctness phase's rule (workflows/tensor/under_load.py)."""

    measured: int = 0  # answers measured under load
    checked: int = 0
    beyond: int = 0  # checked answers beyond tolerance
    first_request: int = -1  # index in its scenario of the first one beyond (-1: none)
    first_batch: int = 0
    first_reason: str = ""
    batches_beyond: list[int] = field(default_factory=list)
    batches_checked: list[int] = field(default_factory=list)
    skipped: str = ""  # why some or all were not checked


@dataclass
class TrainRequest:
    target: Target
    plan: TrainingPlan
    reference_loss: list[float] = field(default_factory=list)


@dataclass
class LossComparison:
    """The evaluator's CompareLoss verdict on two loss curves."""

    passed: bool
    deviation: list[float]
    max_relative_deviation: float
    reference_steps_to_target: int
    candidate_steps_to_target: int
    reasons: list[str]
    justification: str


@dataclass
class TrainResult:
    loss: list[float]
    step_seconds: list[float]
    total_s: float
    comparison: LossComparison | None = None  # None: no reference curve to compare with
    distributed: dict[str, Any] = field(default_factory=dict)  # training.distributed: both runs

    def to_json(self) -> dict[str, Any]:
        comparison = dataclasses.asdict(self.comparison) if self.comparison else {}
        return {**dataclasses.asdict(self), "comparison": comparison}


@dataclass
class UsageRecord:
    """Non-job usage of a path (golden, correctness, training): charged to the path."""

    target: Target
    phase: str
    busy_us: int
    started_unix_us: int
    ended_unix_us: int
    reservation_id: str


@dataclass
class CloseRequest:
    target: Target
    reservation_id: str
    end_unix_us: int = 0
    unload: bool = True
    restore: ServingConfig | None = None  # None = unload


@dataclass
class EconomicsRequest:
    target: Target
    reservation_id: str
    since_unix_us: int
    end_unix_us: int


@dataclass
class EconomicsResult:
    currency: str
    total_micros: int
    busy_micros: int
    idle_micros: int
    prepare_micros: int
    reserved_micros: int
    jobs_completed: int
    jobs_failed: int
    cost_per_completed_job_micros: int
    unpriced: bool
    unpriced_events: int
    # Generation (docs/ledger.md "Tokens"): 0 when the trial's requests carried no tokens.
    prompt_tokens: int = 0
    output_tokens: int = 0
    generation_micros: int = 0
    generation_jobs_completed: int = 0
    cost_per_completed_generation_job_micros: int = 0
    cost_per_million_output_tokens_micros: int = 0
    cost_per_million_prompt_tokens_micros: int = 0
    example_priced_lines: int = 0  # charged at an example price (`switchyard up`'s book)


EXAMPLE_PRICES = (
    "at the EXAMPLE price book (switchyard up's, not finance's; `switchyard prices set` replaces it)"
)


def example_note(*economics: EconomicsResult | None) -> str:
    """What a cost figure says when any of its lines were charged at an example price."""
    return f"; {EXAMPLE_PRICES}" if any(e is not None and e.example_priced_lines for e in economics) else ""


@dataclass
class TrialRecord:
    trial_id: str
    workflow_id: str
    model: str
    status: str
    spec_json: str
    report_json: str = ""
    verdicts: dict[str, str] = field(default_factory=dict)
