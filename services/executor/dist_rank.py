"""One rank of a distributed training run, started by the executor (`dist_launch`).

    python -m services.executor.dist_rank JOB_DIR RANK [--label TRIAL/PATH]

JOB_DIR holds `job.json` (the DistributedConfig and the plan) and `job.pt` (the module on the
CPU in fp32). Every rank draws the same seeded global batch (the same batch every step) and takes
its own rows, so the ranks together compute exactly the single-process step on that batch.
A rank writes `rank-<r>.progress` (steps done) after each step, then `rank-<r>.json` (its
result) or, when it fails, `rank-<r>.error` (the error, one line). With launch `xla_launch`,
RANK is -1 and the process makes the replicas, each taking its global ordinal as rank: a thread
per PJRT CPU device in this process, or, on TPU, `torch_xla.launch`'s process per chip.
The process-group details live in `services.executor.distributed`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from services.executor.distributed import (
    DistributedConfig,
    RankOps,
    init_process_group,
    peak_memory,
    single_device,
)

PEER_FAILED = "a peer replica failed first"
_replicas: tuple[threading.Lock, threading.Barrier] | None = None
_replicas_lock = threading.Lock()


def _resolve(name: str) -> Any:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def run_rank(job_dir: Path, rank: int, local_rank: int, replicas: Any = None) -> None:
    import torch

    job = json.loads((job_dir / "job.json").read_text())
    config = DistributedConfig.from_json(job["config"])
    try:
        _train(job_dir, job, config, rank, local_rank, replicas)
    except BaseException as exc:
        if replicas is not None:
            replicas[1].abort()  # the peer thread stops waiting instead of timing out
        broken = isinstance(exc, threading.BrokenBarrierError)
        message = PEER_FAILED if broken else f"{type(exc).__name__}: {exc}".splitlines()[0][:2000]
        (job_dir / f"rank-{rank}.error").write_text(message)
        (job_dir / f"rank-{rank}.trace").write_text(traceback.format_exc())
        raise
    finally:
        if config.world_size > 1 and config.backend != "xla" and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(
    job_dir: Path, job: dict[str, Any], config: DistributedConfig, rank: int, local_rank: int, replicas: Any
) -> None:
    import torch

    from services.executor.training_optim import momentum_sgd

    if config.path == "cpu":  # ranks share the host's cores; oversubscribed OpenMP pools crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    module = torch.load(job_dir / "job.pt", weights_only=False)["module"]
    train_batch, batch_loss = _resolve(job["train_batch"]), _resolve(job["batch_loss"])
    dtype = getattr(torch, job["dtype"])
    steps, per_rank, seed = int(job["steps"]), int(job["per_rank_batch"]), int(job["seed"])
    if config.world_size > 1:
        device = init_process_group(config, rank, local_rank)
    else:
        device = single_device(config.path)
    ops = RankOps(config, replicas)
    module = module.to(device=device, dtype=dtype).train()
    model = ops.wrap(module, device)
    optimizer = momentum_sgd(module, float(job["lr"]))
    ops.sync()  # also makes the zero momentum buffers device data before step 1
    # the same seeded global batch every step (as single-process Train): a curve that must fall
    data = train_batch(per_rank * config.world_size, torch.Generator().manual_seed(seed))
    mine = [t[rank * per_rank : (rank + 1) * per_rank] for t in data]
    losses: list[Any] = []
    step_s: list[float] = []
    comm_s: list[float] = []
    for step in range(steps):
        ops.comm_s = 0.0
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(model, mine, dtype, device)
        loss.backward()
        recorded = ops.reduce_gradients(module, loss)
        optimizer.step()
        ops.sync()
        step_s.append(time.perf_counter() - start)
        comm_s.append(ops.comm_s)
        losses.append(float(recorded.to("cpu", torch.float64)))
        (job_dir / f"rank-{rank}.progress").write_text(str(step + 1))
    memory, source = peak_memory(config.path)
    result = {
        "rank": rank,
        "loss": ops.global_losses(losses),
        "step_seconds": step_s,
        "comm_seconds": comm_s,
        "comm_measured": ops.comm_measured,
        "peak_memory_bytes": memory,
        "memory_source": source,
        "device": str(device),
    }
    (job_dir / f"rank-{rank}.json").write_text(json.dumps(result))


def xla_replica(index: int, job_dir: str) -> None:
    """One torch_xla replica (a thread per PJRT CPU device, a process per TPU chip)."""
    import torch_xla.runtime as xr

    global _replicas
    job = json.loads((Path(job_dir) / "job.json").read_text())
    config = DistributedConfig.from_json(job["config"])
    replicas = None
    if xr.addressable_device_count() > 1:  # threads of this process share the lock and barrier
        with _replicas_lock:
            if _replicas is None:
                _replicas = (threading.Lock(), threading.Barrier(config.world_size, timeout=config.timeout_s))
            replicas = _replicas
    rank = int(xr.global_ordinal())
    run_rank(Path(job_dir), rank, rank, replicas)


def main(argv: list[str]) -> int:
    job_dir, rank = Path(argv[0]), int(argv[1])
    if rank < 0:
        import torch_xla

        from services.executor import dist_rank  # by module name, so spawn can pickle it

        if os.environ.get("PJRT_DEVICE") == "CPU":
            # PJRT CPU has no cross-process collectives, so its replicas are threads of one
            # process. torch_xla.launch would start them in a child process of this one; they
            # run in this process instead, so the rank process the executor started (and a
            # signal to it) is the process of the replicas. torch_xla's own thread-per-device
            # runner, after the replication setup that torch_xla.launch does for its child.
            import torch_xla.core.xla_model as xm
            from torch_xla._internal import pjrt

            xm.set_replication(torch_xla.device(), xm.get_xla_supported_devices())
            pjrt.spawn_threads(dist_rank.xla_replica, args=(str(job_dir),))
        else:  # TPU: a process per chip
            torch_xla.launch(dist_rank.xla_replica, args=(str(job_dir),))
        return 0
    try:
        run_rank(job_dir, rank, rank)
    except BaseException:
        return 1
    return 0


def exit_now(code: int) -> None:
    """Ends the rank process without the interpreter's finalization; every result and error
    file is written and closed by now. Finalization runs C++ static destructors while a gloo
    or TCPStore thread may still be joinable, and now and then (2 of 33 two-rank gloo runs
    here) that aborts the process ("terminate called without an active exception", SIGABRT)
    after it wrote a complete result, so a finished rank was reported as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
