"""The distributed part of a trial's training phase (`training.distributed` in the spec).

On each path the executor trains twice from the same weights on the same seeded global batch:
once in a single process (world size 1, the whole global batch) and once across the plan's
ranks (each rank its share of the rows). The activity then reports, with every size:
- the loss per step of both runs, and the distributed curve against the single-process one
  (the evaluator's CompareLoss at the path's precision); against the reference path's
  distributed curve it is compared by the caller as for single-process training;
- samples/s and tokens/s of both runs (global batch / step time, steps after the first,
  which carries the compilation and warm-up);
- the share of step time spent in timed collectives, and the peak memory per rank;
- the scaling: speed-up = single-process step time / distributed step time at the same global
  batch (strong scaling), efficiency = speed-up / world size.
A run whose rank failed raises a non-retryable error naming the rank, so the path becomes
INCONCLUSIVE with that error rather than retrying a job that already tore its ranks down.
"""

from __future__ import annotations

import statistics
from typing import Any

from temporalio.exceptions import ApplicationError

from switchyard.gen.switchyard.v1 import executor_pb2 as xpb
from workflows.spec.trial_spec import TrainingPlan


def request(
    target_model: str, version: str, plan: TrainingPlan, world_size: int, label: str
) -> xpb.TrainRequest:
    d = plan.distributed
    assert d is not None, "a distributed run needs training.distributed"
    global_batch = d.world_size * d.per_rank_batch
    return xpb.TrainRequest(
        model_name=target_model,
        version=version,
        steps=plan.steps,
        lr=plan.lr,
        seed=d.seed,
        label=label,
        distributed=xpb.DistributedTraining(
            world_size=world_size,
            strategy=d.strategy if world_size > 1 else "ddp",
            per_rank_batch=global_batch // world_size,
            timeout_s=d.timeout_s,
        ),
    )


def check(response: xpb.TrainResponse, path: str, what: str) -> None:
    r = response.distributed
    if r.ok:
        return
    # a failed rank < 0: the error names the ranks (the replicas of one process that died)
    who = f"rank {r.failed_rank} failed: " if r.failed_rank >= 0 else ""
    rest = "the other ranks were" if r.failed_rank >= 0 else "every rank's process was"
    raise ApplicationError(
        f"{what} on {path} ({r.process_group_backend}, world size {r.world_size}): {who}"
        f"{r.error}; {rest} torn down",
        type="RankFailed",
        non_retryable=True,
    )


def _measured(seconds: list[float]) -> list[float]:
    return seconds[1:] if len(seconds) > 1 else seconds


def summary(response: xpb.TrainResponse) -> dict[str, Any]:
    """One run's figures, each with its sizes."""
    r = response.distributed
    steps = _measured(list(response.step_seconds))
    step_s = statistics.median(steps) if steps else 0.0
    comm = [max(c) for c in zip(*(list(k.comm_seconds) for k in r.ranks), strict=False)]
    comm_share = (sum(_measured(comm)) / sum(steps)) if r.comm_measured and steps and sum(steps) else None
    return {
        "process_group_backend": r.process_group_backend,
        "launch": r.launch,
        "world_size": r.world_size,
        "strategy": r.strategy if r.world_size > 1 else "single process",
        "per_rank_batch": r.per_rank_batch,
        "global_batch": r.global_batch,
        "tokens_per_sample": r.tokens_per_sample,
        "loss": list(response.loss),
        "step_seconds": list(response.step_seconds),
        "median_step_s": step_s,
        "samples_per_s": r.global_batch / step_s if step_s else 0.0,
        "tokens_per_s": r.global_batch * r.tokens_per_sample / step_s if step_s else 0.0,
        "comm_share": comm_share,
        "comm_basis": (
            "timed collectives (DDP all-reduce hook / xla all-reduce graph), overlapping backward"
            if comm_share is not None
            else "not separated (single process, or FSDP2 collectives inside forward and backward)"
        ),
        "ranks": [
            {
                "rank": k.rank,
                "device": k.device,
                "peak_memory_bytes": k.peak_memory_bytes,
                "memory_source": k.memory_source,
                "error": k.error,
            }
            for k in r.ranks
        ],
        "total_s": response.total_s,
    }


def scaling(single: dict[str, Any], multi: dict[str, Any]) -> dict[str, Any]:
    speedup = single["median_step_s"] / multi["median_step_s"] if multi["median_step_s"] else 0.0
    return {
        "basis": "strong scaling: the same global batch in 1 process and across the ranks",
        "global_batch": multi["global_batch"],
        "world_sizes": [single["world_size"], multi["world_size"]],
        "step_s": [single["median_step_s"], multi["median_step_s"]],
        "samples_per_s": [single["samples_per_s"], multi["samples_per_s"]],
        "speedup": speedup,
        "efficiency": speedup / multi["world_size"] if multi["world_size"] else 0.0,
    }
