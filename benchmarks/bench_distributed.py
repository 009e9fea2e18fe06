"""Distributed scaling: tiny-lm DDP at world size 1 vs N on one path, the same global batch.

    python -m benchmarks.bench_distributed [--path cpu] [--world-size 2] [--global-batch 16] [--steps 12]

Runs the executor's own launcher (services.executor.dist_launch) twice in this run: one
process with the whole global batch (the baseline), then N ranks with global/N rows each.
Prints the median step time after the first step (which carries warm-up), samples/s,
tokens/s, the communication share (timed all-reduce) and the speed-up and efficiency against
the baseline, with every size; writes out/bench/distributed.json. Run it from the env of the
path (the XLA env's python for --path xla).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks.common import write_report
from services.executor import distributed
from services.executor.dist_launch import DistributedRun, run_distributed
from switchyard.models import tiny_lm


def _figures(run: DistributedRun) -> dict[str, Any]:
    steps = run.step_seconds()[1:] or run.step_seconds()
    comm = run.comm_seconds()[1:] or run.comm_seconds()
    step_s = statistics.median(steps)
    return {
        "world_size": run.config.world_size,
        "backend": run.config.backend,
        "launch": run.config.launch,
        "per_rank_batch": run.per_rank_batch,
        "global_batch": run.global_batch,
        "tokens_per_sample": run.tokens_per_sample,
        "median_step_s": step_s,
        "samples_per_s": run.global_batch / step_s,
        "tokens_per_s": run.global_batch * run.tokens_per_sample / step_s,
        "comm_share": sum(comm) / sum(steps) if run.comm_measured else None,
        "peak_memory_bytes": [r.peak_memory_bytes for r in run.ranks],
        "final_loss": run.loss[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--path", default="cpu")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    if args.global_batch % args.world_size:
        parser.error("--global-batch must be a multiple of --world-size")
    module = tiny_lm.build()
    runs = []
    for world in (1, args.world_size):
        config = distributed.plan(args.path, world, "ddp", 60.0)
        run = run_distributed(
            module, tiny_lm.train_batch, tiny_lm.batch_loss, torch.float32, config, args.steps, 0.05, 3,
            args.global_batch // world,
        )  # fmt: skip
        if not run.ok:
            print(f"world size {world} failed: rank {run.failed_rank}: {run.error}")
            return 1
        runs.append(_figures(run))
    base, multi = runs
    speedup = base["median_step_s"] / multi["median_step_s"]
    for r in runs:
        comm = f"{r['comm_share']:.1%}" if r["comm_share"] is not None else "n/a"
        print(
            f"{args.path} {r['backend']} world {r['world_size']}: {r['per_rank_batch']}/rank, global "
            f"{r['global_batch']} x {r['tokens_per_sample']} tokens: step {r['median_step_s'] * 1e3:.1f} ms, "
            f"{r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:.0f} tokens/s, comm {comm}"
        )
    print(
        f"speed-up world 1 -> {args.world_size}: {speedup:.2f}x, efficiency "
        f"{speedup / args.world_size:.0%} (same global batch {args.global_batch})"
    )
    write_report(
        "distributed",
        {"path": args.path, "steps": args.steps, "runs": runs, "speedup": speedup,
         "efficiency": speedup / args.world_size},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
