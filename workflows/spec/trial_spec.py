"""The trial specification: one JSON object, parsed once into frozen dataclasses
(docs/architecture.md#trials).

`parse_spec` checks every field and raises `SpecError` naming the field by its JSON path
(e.g. `paths[1].precision`) and what to send instead, so an operator who pastes a spec into
the Temporal UI learns at once what is wrong. The module is pure (no I/O, no clock), so the
workflow can run it inside Temporal's sandbox. docs/trial-spec.md documents every field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from switchyard.judge.tolerances import Tolerances
from workflows.spec.fields import Fields, SpecError
from workflows.tensor.intervals import MIN_BLOCKS

PRECISIONS = ("fp32", "bf16", "fp16")
MODES = ("eager", "compile", "lazy", "strict", "debug", "defer_and_fuse")
SCENARIOS = ("single-stream", "offline", "generation")
DEFAULT_SCENARIOS = ("single-stream", "offline")
DISTRIBUTIONS = ("fixed", "uniform", "normal")
STRATEGIES = ("ddp", "fsdp")
COMPATIBILITY_ACTIONS = ("reject", "warn")
DATATYPES = ("FP64", "FP32", "FP16", "BF16", "INT64", "INT32", "INT16", "INT8", "UINT8", "BOOL")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")

__all__ = ["SpecError", "TrialSpec", "parse_spec"]


@dataclass(frozen=True)
class ModelRef:
    name: str
    version: str = ""
    checkpoint_sha256: str = ""


@dataclass(frozen=True)
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]  # including the batch dimension
    low: float = 0.0  # integers: uniform in [low, high); floats: normal(low, high) = (mean, std)
    high: float = 1.0


@dataclass(frozen=True)
class Lengths:
    """Token lengths: fixed (`value`), uniform in [min, max], or normal (mean, std), clipped."""

    distribution: str = "fixed"
    value: int = 16
    min: int = 1
    max: int = 1
    mean: float = 0.0
    std: float = 0.0


@dataclass(frozen=True)
class Prompts:
    """A generative model's correctness prompts: seeded token ids in [low, high) of `length`
    tokens, or the given `texts`; each greedy for `max_tokens` new tokens (EOS ignored)."""

    count: int = 4
    length: Lengths = field(default_factory=Lengths)
    max_tokens: int = 16
    low: int = 0
    high: int = 0
    texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Inputs:
    seed: int
    tensors: tuple[InputTensor, ...] = ()
    file: str = ""  # a .npz of named arrays instead of generated tensors
    file_sha256: str = ""
    workload: str = ""  # a workload captured at the router, replayed in order
    workload_sha256: str = ""
    prompts: Prompts | None = None  # a generative model's prompts (performance: generation)


@dataclass(frozen=True)
class PathSpec:
    name: str
    executor: str  # "host:port" or a name the worker resolves (e.g. "cpu", "xla")
    mode: str
    precision: str = "fp32"
    version: str = ""  # overrides model.version for this path (e.g. a "perturbed" variant)


@dataclass(frozen=True)
class Criteria(Tolerances):
    """The spec's `criteria`: the tolerances (each path's precision picks their defaults)."""

    outputs: tuple[str, ...] = ()  # outputs to compare; () = all


@dataclass(frozen=True)
class GenerationPlan:
    """The generation scenario: `requests` streamed requests per load level; a level per
    `concurrency` (closed loop) and per `request_rates` entry (Poisson, seeded)."""

    requests: int = 16
    concurrency: tuple[int, ...] = (1, 4)
    request_rates: tuple[float, ...] = ()
    max_concurrency: int = 0  # caps Poisson arrivals in flight; 0 = no cap
    seed: int = 0
    prompt_len: Lengths = field(default_factory=lambda: Lengths("uniform", 16, 4, 16))
    output_len: Lengths = field(default_factory=lambda: Lengths("fixed", 16))
    low: int = 0  # prompt token ids in [low, high); 0, 0 = inputs.prompts' range
    high: int = 0
    workload: str = ""  # lengths (and prompts) from a workload captured at the router
    workload_sha256: str = ""


@dataclass(frozen=True)
class PerformancePlan:
    warmup: int = 5
    min_iterations: int = 50
    min_seconds: float = 2.0
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    batch_sizes: tuple[int, ...] = (1, 8)
    offline_concurrency: int = 4
    batch_buckets: tuple[int, ...] = ()  # () = batch_sizes plus the correctness batch
    generation: GenerationPlan | None = None
    blocks: int = 10  # each scenario's samples in blocks of consecutive requests (intervals)
    interleave: bool = True  # paths sharing the reference's host alternate blocks with it
    # single-stream requests per path an interleaved measurement may add, in more paired
    # blocks, while a latency interval straddles its bound (workflows/tensor/extension.py)
    max_extra_requests: int = 100


@dataclass(frozen=True)
class DistributedPlan:
    world_size: int = 2
    strategy: str = "ddp"
    per_rank_batch: int = 4
    seed: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class TrainingPlan:
    steps: int = 10
    lr: float = 0.01
    seed: int = 0
    batch_size: int = 4
    target_loss: float = 0.0  # 0 = none
    max_relative_deviation: float = 0.0  # 0 = the evaluator's: 1% in fp32, 5% in bf16 and fp16
    distributed: DistributedPlan | None = None


@dataclass(frozen=True)
class Policy:
    min_cost_saving: float = 0.0  # share of the reference's cost per completed job, e.g. 0.1
    max_p95_regression: float = 0.1  # share of the reference's single-stream p95 latency
    require_training: bool = False
    amortize_over_jobs: int = 0  # 0 = the trial's own jobs carry the preparation cost
    max_fallback_ops: int = 0  # distinct ops a candidate may run on the host instead of its device
    max_graph_breaks: int = 0
    compatibility_action: str = "reject"  # beyond a maximum: "reject" or "warn"
    # generation trials: latency is p99 TTFT and TPOT, cost is per million output tokens
    max_ttft_p99_regression: float = 0.1
    max_tpot_p99_regression: float = 0.1
    min_output_token_cost_saving: float = 0.0
    slo_ttft_ms: float = 0.0  # goodput: a request counts if it meets every SLO set (0 = unset)
    slo_tpot_ms: float = 0.0
    slo_e2el_ms: float = 0.0
    confidence: float = 0.95  # the level of every ratio's interval; decided on the whole interval
    max_latency_drift: float = 0.25  # last third vs first third of a measurement (0 = unchecked)
    max_memory_growth_mib: float = 1.0  # process memory growth, MiB per 1,000 requests (0 = unchecked)


@dataclass(frozen=True)
class Timeouts:
    heartbeat_s: float = 30.0
    activity_s: float = 900.0
    max_attempts: int = 3


@dataclass(frozen=True)
class TrialSpec:
    model: ModelRef
    inputs: Inputs
    paths: tuple[PathSpec, ...]
    reference: str
    criteria: Criteria = field(default_factory=Criteria)
    performance: PerformancePlan = field(default_factory=PerformancePlan)
    training: TrainingPlan | None = None
    policy: Policy = field(default_factory=Policy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    team: str = ""
    description: str = ""

    def path(self, name: str) -> PathSpec:
        return next(p for p in self.paths if p.name == name)

    @property
    def reference_path(self) -> PathSpec:
        return self.path(self.reference)

    @property
    def candidates(self) -> tuple[PathSpec, ...]:
        return tuple(p for p in self.paths if p.name != self.reference)

    @property
    def generative(self) -> bool:
        return self.inputs.prompts is not None


def _model(f: Fields) -> ModelRef:
    sha = f.text("checkpoint_sha256", default="")
    if sha and not _SHA.match(sha):
        raise SpecError(f.at("checkpoint_sha256"), "must be 64 lowercase hex digits (a sha256)")
    model = ModelRef(f.name("name", _NAME), f.text("version", default=""), sha)
    f.done()
    return model


def _input_tensor(f: Fields) -> InputTensor:
    datatype = f.choice("datatype", DATATYPES)
    shape = f.ints("shape", minimum=1)
    if not shape:
        raise SpecError(f.at("shape"), "needs at least the batch dimension, e.g. [4, 16]")
    floating = datatype in ("FP64", "FP32", "FP16", "BF16")
    low = f.number("low", default=0.0)
    high = f.number("high", default=1.0 if floating else 2.0)
    if not floating and high <= low:
        raise SpecError(
            f.at("high"), f"must be greater than low ({low:g}): integers are drawn from [low, high)"
        )
    if floating and high < 0:
        raise SpecError(f.at("high"), "is the standard deviation of float inputs and must be >= 0")
    tensor = InputTensor(f.name("name", _NAME), datatype, tuple(shape), low, high)
    f.done()
    return tensor


def _lengths(f: Fields, default: Lengths, limit: str) -> Lengths:
    kind = f.choice("distribution", DISTRIBUTIONS, default=default.distribution)
    if kind == "fixed":
        out = Lengths(kind, value=f.integer("value", default.value, minimum=1))
    elif kind == "uniform":
        low = f.integer("min", default.min, minimum=1)
        out = Lengths(kind, min=low, max=f.integer("max", max(default.max, low), minimum=1))
        if out.max < out.min:
            raise SpecError(f.at("max"), f"must be >= min ({out.min})")
    else:
        out = Lengths(kind, mean=f.number("mean", minimum=1.0), std=f.number("std", minimum=0.0))
    top = out.value if kind == "fixed" else out.max if kind == "uniform" else out.mean
    if top > 65536:
        raise SpecError(f.path, f"{limit} of {top:g} tokens is beyond any model's context")
    f.done()
    return out


def _prompts(f: Fields) -> Prompts:
    texts = tuple(f.strs("texts", []))
    if texts:
        if any(not t for t in texts):
            raise SpecError(f.at("texts"), "an empty prompt cannot be generated from")
        f.seen.update({"count", "length", "low", "high"})
        out = Prompts(len(texts), Lengths(), f.integer("max_tokens", 16, minimum=1), texts=texts)
    else:
        out = Prompts(
            count=f.integer("count", 4, minimum=1),
            length=_lengths(f.obj("length"), Lengths("fixed", 8), "a prompt"),
            max_tokens=f.integer("max_tokens", 16, minimum=1),
            low=f.integer("low", 0, minimum=0),
            high=f.integer("high"),
        )
        if out.high <= out.low:
            raise SpecError(
                f.at("high"), f"must be greater than low ({out.low}): token ids are drawn from [low, high)"
            )
    if out.count > 256:
        raise SpecError(f.at("count"), "must be at most 256 (their tokens travel through Temporal)")
    if out.max_tokens > 4096:
        raise SpecError(f.at("max_tokens"), "must be at most 4096")
    f.done()
    return out


def _inputs(f: Fields) -> Inputs:
    if f.has("prompts"):
        prompts = _prompts(f.obj("prompts"))
        seed = f.integer("seed", 0, minimum=0)
        for other in ("tensors", "file", "workload"):
            if f.has(other):
                raise SpecError(f.at(other), "a generation trial's inputs are its prompts: give no "
                                f"{other} with them")  # fmt: skip
        f.done()
        return Inputs(seed, prompts=prompts)
    f.seen.add("prompts")
    workload = f.text("workload", default="")
    seed = f.integer("seed", default=0, minimum=0) if workload else f.integer("seed", minimum=0)
    tensors = tuple(_input_tensor(t) for t in f.objects("tensors", default=[]))
    file = f.text("file", default="")
    sha = f.text("file_sha256", default="")
    if workload:
        workload_sha = f.text("sha256", default="")
        if tensors or file:
            raise SpecError(f.at("workload"), "replays captured requests: give no tensors or file with it")
        if not _SHA.match(workload_sha):
            raise SpecError(
                f.at("sha256"), "a workload needs its sha256 (`switchyard workloads list` shows it)"
            )
        f.done()
        return Inputs(seed, workload=workload, workload_sha256=workload_sha)
    f.seen.add("sha256")
    if bool(tensors) == bool(file):
        raise SpecError(
            f.at("tensors"), "give tensors (generated from the seed), a file, or a captured workload"
        )
    if file and not _SHA.match(sha):
        raise SpecError(f.at("file_sha256"), "a file needs its sha256 (64 lowercase hex digits)")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise SpecError(f.at("tensors"), f"input names repeat: {names}")
    batches = {t.shape[0] for t in tensors}
    if len(batches) > 1:
        raise SpecError(f.at("tensors"), f"all inputs need the same batch dimension, got {sorted(batches)}")
    f.done()
    return Inputs(seed, tensors, file, sha)


def _path(f: Fields) -> PathSpec:
    path = PathSpec(
        name=f.name("name", _NAME),
        executor=f.text("executor"),
        mode=f.choice("mode", MODES),
        precision=f.choice("precision", PRECISIONS, default="fp32"),
        version=f.text("version", default=""),
    )
    if not path.executor:
        raise SpecError(f.at("executor"), "give an executor address host:port or a name the worker knows")
    f.done()
    return path


def _criteria(f: Fields) -> Criteria:
    criteria = Criteria(
        logits=f.flag("logits", False),
        error_multiplier=f.number("error_multiplier", 0.0, minimum=0.0),
        min_cosine=f.number("min_cosine", 0.0, minimum=0.0),
        min_top1_agreement=f.number("min_top1_agreement", 0.0, minimum=0.0),
        min_topk_agreement=f.number("min_topk_agreement", 0.0, minimum=0.0),
        top_k=f.integer("top_k", 0, minimum=0),
        max_kl=f.number("max_kl", 0.0, minimum=0.0),
        atol_floor=f.number("atol_floor", 0.0, minimum=0.0),
        outputs=tuple(f.strs("outputs", [])),
    )
    for key in ("min_cosine", "min_top1_agreement", "min_topk_agreement"):
        if getattr(criteria, key) > 1:
            raise SpecError(f.at(key), "is a share and must be between 0 and 1")
    f.done()
    return criteria


def _generation(f: Fields, seed: int) -> GenerationPlan:
    d = GenerationPlan()
    raw_rates = f.items("request_rates", [])
    for i, r in enumerate(raw_rates):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 or r > 10000:
            raise SpecError(
                f"{f.at('request_rates')}[{i}]", f"must be a rate in (0, 10000] requests/s, got {r!r}"
            )
    rates = tuple(float(r) for r in raw_rates)
    workload = f.text("workload", default="")
    workload_sha = f.text("sha256", default="")
    if workload and not _SHA.match(workload_sha):
        raise SpecError(f.at("sha256"), "a workload needs its sha256 (`switchyard workloads list` shows it)")
    plan = GenerationPlan(
        requests=f.integer("requests", d.requests, minimum=1),
        concurrency=tuple(f.ints("concurrency", [] if rates else list(d.concurrency), minimum=1)),
        request_rates=rates,
        max_concurrency=f.integer("max_concurrency", 0, minimum=0),
        seed=f.integer("seed", seed, minimum=0),
        prompt_len=_lengths(f.obj("prompt_len"), d.prompt_len, "a prompt"),
        output_len=_lengths(f.obj("output_len"), d.output_len, "an output"),
        low=f.integer("low", 0, minimum=0),
        high=f.integer("high", 0, minimum=0),
        workload=workload,
        workload_sha256=workload_sha,
    )
    if not plan.concurrency and not plan.request_rates:
        raise SpecError(f.at("concurrency"), "needs a concurrency level or a request rate to measure at")
    if plan.requests > 100_000:
        raise SpecError(f.at("requests"), "must be at most 100000 per load level")
    if plan.high and plan.high <= plan.low:
        raise SpecError(f.at("high"), f"must be greater than low ({plan.low})")
    f.done()
    return plan


def _performance(f: Fields, seed: int = 0) -> PerformancePlan:
    d = PerformancePlan()
    generation = _generation(f.obj("generation"), seed) if f.has("generation") else None
    f.seen.add("generation")
    plan = PerformancePlan(
        warmup=f.integer("warmup", d.warmup, minimum=0),
        min_iterations=f.integer("min_iterations", d.min_iterations, minimum=1),
        min_seconds=f.number("min_seconds", d.min_seconds, minimum=0.0),
        scenarios=tuple(f.strs("scenarios", list(d.scenarios), options=SCENARIOS)),
        batch_sizes=tuple(f.ints("batch_sizes", list(d.batch_sizes), minimum=1)),
        offline_concurrency=f.integer("offline_concurrency", d.offline_concurrency, minimum=1),
        batch_buckets=tuple(f.ints("batch_buckets", [], minimum=1)),
        generation=generation,
        blocks=f.integer("blocks", d.blocks, minimum=MIN_BLOCKS),
        interleave=f.flag("interleave", d.interleave),
        max_extra_requests=f.integer("max_extra_requests", d.max_extra_requests, minimum=0),
    )
    if generation is not None and "generation" not in plan.scenarios:
        plan = dataclasses.replace(plan, scenarios=("generation",))
    if "generation" in plan.scenarios and len(plan.scenarios) > 1:
        raise SpecError(
            f.at("scenarios"),
            "generation is measured alone (single-stream and offline are for one-pass models)",
        )
    if "generation" in plan.scenarios and generation is None:
        plan = dataclasses.replace(plan, generation=GenerationPlan(seed=seed))
    if not plan.scenarios:
        raise SpecError(f.at("scenarios"), f"needs at least one of {', '.join(SCENARIOS)}")
    if not plan.batch_sizes:
        raise SpecError(f.at("batch_sizes"), "needs at least one batch size, e.g. [1, 8]")
    if plan.min_seconds > 3600:
        raise SpecError(f.at("min_seconds"), "must be at most 3600 per scenario")
    if plan.max_extra_requests > 100_000:
        raise SpecError(f.at("max_extra_requests"), "must be at most 100000 per path")
    f.done()
    return plan


def _distributed(f: Fields, seed: int) -> DistributedPlan:
    plan = DistributedPlan(
        world_size=f.integer("world_size", 2, minimum=1),
        strategy=f.choice("strategy", STRATEGIES, default="ddp"),
        per_rank_batch=f.integer("per_rank_batch", 4, minimum=1),
        seed=f.integer("seed", seed, minimum=0),
        timeout_s=f.number("timeout_s", 60.0, minimum=1.0),
    )
    if plan.world_size > 64:
        raise SpecError(f.at("world_size"), "must be at most 64")
    if plan.timeout_s > 3600:
        raise SpecError(f.at("timeout_s"), "must be at most 3600 seconds")
    f.done()
    return plan


def _training(f: Fields) -> TrainingPlan:
    seed = f.integer("seed", 0, minimum=0)
    distributed = _distributed(f.obj("distributed"), seed) if f.has("distributed") else None
    f.seen.add("distributed")
    plan = TrainingPlan(
        steps=f.integer("steps", 10, minimum=1),
        lr=f.number("lr", 0.01, minimum=0.0),
        seed=seed,
        batch_size=f.integer("batch_size", 4, minimum=1),
        target_loss=f.number("target_loss", 0.0, minimum=0.0),
        max_relative_deviation=f.number("max_relative_deviation", 0.0, minimum=0.0),
        distributed=distributed,
    )
    if plan.lr <= 0:
        raise SpecError(f.at("lr"), "must be > 0")
    f.done()
    return plan


def _policy(f: Fields) -> Policy:
    policy = Policy(
        min_cost_saving=f.number("min_cost_saving", 0.0),
        max_p95_regression=f.number("max_p95_regression", 0.1, minimum=0.0),
        require_training=f.flag("require_training", False),
        amortize_over_jobs=f.integer("amortize_over_jobs", 0, minimum=0),
        max_fallback_ops=f.integer("max_fallback_ops", 0, minimum=0),
        max_graph_breaks=f.integer("max_graph_breaks", 0, minimum=0),
        compatibility_action=f.choice("compatibility_action", COMPATIBILITY_ACTIONS, default="reject"),
        max_ttft_p99_regression=f.number("max_ttft_p99_regression", 0.1, minimum=0.0),
        max_tpot_p99_regression=f.number("max_tpot_p99_regression", 0.1, minimum=0.0),
        min_output_token_cost_saving=f.number("min_output_token_cost_saving", 0.0),
        slo_ttft_ms=f.number("slo_ttft_ms", 0.0, minimum=0.0),
        slo_tpot_ms=f.number("slo_tpot_ms", 0.0, minimum=0.0),
        slo_e2el_ms=f.number("slo_e2el_ms", 0.0, minimum=0.0),
        confidence=f.number("confidence", 0.95),
        max_latency_drift=f.number("max_latency_drift", 0.25, minimum=0.0),
        max_memory_growth_mib=f.number("max_memory_growth_mib", 1.0, minimum=0.0),
    )
    if not 0.5 <= policy.confidence < 1.0:
        raise SpecError(
            f.at("confidence"),
            f"is the intervals' level, at least 0.5 and below 1, got {policy.confidence:g}",
        )
    if not -1.0 < policy.min_output_token_cost_saving < 1.0:
        raise SpecError(
            f.at("min_output_token_cost_saving"),
            "is a share of the reference's cost per million output tokens, between -1 and 1",
        )
    if not -1.0 < policy.min_cost_saving < 1.0:
        raise SpecError(f.at("min_cost_saving"), "is a share of the reference's cost, between -1 and 1")
    f.done()
    return policy


def _timeouts(f: Fields) -> Timeouts:
    t = Timeouts(
        heartbeat_s=f.number("heartbeat_s", 30.0, minimum=1.0),
        activity_s=f.number("activity_s", 900.0, minimum=5.0),
        max_attempts=f.integer("max_attempts", 3, minimum=1),
    )
    if t.heartbeat_s >= t.activity_s:
        raise SpecError(f.at("heartbeat_s"), f"must be shorter than activity_s ({t.activity_s:g})")
    f.done()
    return t


def parse_spec(data: Any) -> TrialSpec:
    """Parse and check a trial spec (a JSON object); raises SpecError naming the field."""
    f = Fields(data, "")
    paths = tuple(_path(p) for p in f.objects("paths"))
    if len(paths) < 2:
        raise SpecError("paths", f"needs a reference and at least one candidate, got {len(paths)} path(s)")
    names = [p.name for p in paths]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise SpecError(f"paths[{i}].name", f"{name!r} is used by another path; names must be unique")
    reference = f.text("reference")
    if reference not in names:
        raise SpecError("reference", f"{reference!r} is not one of the paths ({', '.join(names)})")
    inputs = _inputs(f.obj("inputs"))
    training = _training(f.obj("training")) if f.has("training") else None
    f.seen.add("training")
    spec = TrialSpec(
        model=_model(f.obj("model")),
        inputs=inputs,
        paths=paths,
        reference=reference,
        criteria=_criteria(f.obj("criteria")),
        performance=_performance(f.obj("performance"), inputs.seed),
        training=training,
        policy=_policy(f.obj("policy")),
        timeouts=_timeouts(f.obj("timeouts")),
        team=f.text("team", default=""),
        description=f.text("description", default=""),
    )
    generation = "generation" in spec.performance.scenarios
    if generation != spec.generative:
        raise SpecError(
            "inputs.prompts" if generation else "performance.scenarios",
            "a generation scenario needs inputs.prompts (the correctness prompts)"
            if generation
            else "inputs.prompts are for a generative model: measure it with the generation scenario",
        )
    gen = spec.performance.generation
    prompts = spec.inputs.prompts
    if gen is not None and prompts is not None and not (gen.workload or gen.high or prompts.high):
        raise SpecError("performance.generation.high", "give the prompt token id range [low, high)")
    if spec.generative and spec.training is not None:
        raise SpecError("training", "a generation trial has no training phase")
    if spec.policy.require_training and spec.training is None:
        raise SpecError("policy.require_training", "is true but the spec has no training plan")
    f.done()
    return spec


def batch_buckets(spec: TrialSpec, correctness_batch: int) -> tuple[int, ...]:
    """Batch sizes each path warms up: the plan's, or every size the trial will send."""
    plan = spec.performance
    sizes = set(plan.batch_buckets or (*plan.batch_sizes, correctness_batch))
    if "single-stream" in plan.scenarios:
        sizes.add(1)
    return tuple(sorted(sizes))
