"""Runs a distributed training job from the executor: starts the ranks, watches them, and
tears every one of them down when one fails, when the run outlives its limit, or at the end.

Each rank is a process of the executor's own interpreter (so the xla executor's ranks run in
the XLA environment) in a session of its own, so a teardown kills the rank and anything it
started (on TPU, torch_xla.launch's process per chip) with one signal. On PJRT CPU the xla
ranks are threads of one such process. The first rank seen to fail names the failure (a
process holding every rank names them all); the others are killed rather than left to time
out in a collective. The run's result carries the loss per step (the global batch's mean),
step and communication times per rank, and peak memory per rank.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.executor import dist_rank
from services.executor.distributed import DistributedConfig, launch_env, prepare_launch

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.02
STARTUP_ALLOWANCE_S = 180.0  # interpreter, torch (and torch_xla) imports, rendezvous, compiles


@dataclass(frozen=True)
class RankResult:
    rank: int
    step_seconds: list[float] = field(default_factory=list)
    comm_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    memory_source: str = ""
    device: str = ""
    error: str = ""
    exit_code: int = 0


@dataclass(frozen=True)
class DistributedRun:
    config: DistributedConfig
    per_rank_batch: int
    tokens_per_sample: int
    loss: list[float]
    ranks: list[RankResult]
    comm_measured: bool
    total_s: float
    ok: bool
    failed_rank: int = -1
    error: str = ""

    @property
    def global_batch(self) -> int:
        return self.per_rank_batch * self.config.world_size

    def step_seconds(self) -> list[float]:
        """A step ends when its slowest rank ends."""
        return [max(steps) for steps in zip(*(r.step_seconds for r in self.ranks), strict=False)]

    def comm_seconds(self) -> list[float]:
        return [max(c) for c in zip(*(r.comm_seconds for r in self.ranks), strict=False)]


def split_objective(train_loss: Any) -> tuple[Any, Any] | None:
    """(train_batch, batch_loss) of a model: the functions of those names in the module of its
    `train_loss` (model.toml), which draw the seeded global batch and take a rank's rows' loss."""
    if train_loss is None:
        return None
    module = sys.modules.get(getattr(train_loss, "__module__", ""))
    batch, loss = getattr(module, "train_batch", None), getattr(module, "batch_loss", None)
    return (batch, loss) if callable(batch) and callable(loss) else None


def _name(fn: Any) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def _tokens_per_sample(train_batch: Any) -> int:
    """Tokens a sample holds: the sequence length of integer (token id) inputs, else 0."""
    first = train_batch(1, torch.Generator().manual_seed(0))[0]
    if first.dtype in (torch.int64, torch.int32) and first.dim() >= 2:
        return int(first.shape[1]) - 1  # next-token data carries one token more than the model sees
    return 0


def _kill(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every rank's session, then SIGKILL what is still there; waits for each."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        alive = [p for p in procs.values() if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    # the sessions may hold children whose leader already exited (torch_xla's replica process)
    for p in procs.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _describe_exit(code: int, log: Path | None = None) -> str:
    lines: list[str] = []
    if log is not None and log.exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    # an XLA runtime abort ("<date> <time>: F <file>] <why>") or a C++ std::terminate, each
    # then SIGABRT, says more than the signal or the traceback
    fatal = [ln for ln in lines if re.match(r"^\S+ \S+: F ", ln) or ln.startswith("terminate called")]
    if code < 0:
        killed = f"killed by signal {signal.Signals(-code).name}"
        return killed + (f": {fatal[-1][:500]}" if fatal else "")
    tail = (fatal or lines or [""])[-1][:500]
    return f"exited with status {code}" + (f": {tail}" if tail else "")


def _failure(
    job_dir: Path, procs: dict[int, subprocess.Popen[bytes]], rank: int, code: int
) -> tuple[int, str]:
    """The failed rank and its error: a rank's own error beats a peer's consequence."""
    errors = {int(p.stem.split("-")[1]): p.read_text().strip() for p in job_dir.glob("rank-*.error")}
    own = {r: e for r, e in errors.items() if e != dist_rank.PEER_FAILED}
    if len(procs) == 1 and own:  # xla_launch: the replicas are inside one process
        first = min(own)
        return first, own[first]
    if rank in own:
        return rank, own[rank]
    log = job_dir / f"launch-{rank}.log"
    if rank >= 0:
        return rank, _describe_exit(code, log)
    if errors:
        return -1, "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    # the process of every replica died before any of them could say why (killed, or XLA
    # aborted it): every rank failed with it
    world_size = int(json.loads((job_dir / "job.json").read_text())["config"]["world_size"])
    ranks = ", ".join(str(r) for r in range(world_size - 1)) + f" and {world_size - 1}"
    return -1, f"ranks {ranks} failed (the replicas of one process): {_describe_exit(code, log)}"


def run_distributed(
    module: nn.Module,
    train_batch: Any,
    batch_loss: Any,
    dtype: torch.dtype,
    config: DistributedConfig,
    steps: int,
    lr: float,
    seed: int,
    per_rank_batch: int,
    label: str = "",
) -> DistributedRun:
    """Trains a copy of `module` with `config.world_size` ranks; never raises for a rank's failure."""
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="switchyard-dist-") as tmp:
        job_dir = Path(tmp)
        cpu_copy = copy.deepcopy(module).to("cpu", torch.float32)
        torch.save({"module": cpu_copy}, job_dir / "job.pt")
        job = {
            "config": config.to_json(),
            "train_batch": _name(train_batch),
            "batch_loss": _name(batch_loss),
            "dtype": str(dtype).removeprefix("torch."),
            "steps": steps,
            "lr": lr,
            "seed": seed,
            "per_rank_batch": per_rank_batch,
        }
        (job_dir / "job.json").write_text(json.dumps(job))
        prepare_launch(config)
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            _launch(job_dir, config, label, procs)
            failed, error = _wait_for_ranks(job_dir, config, steps, procs)
        finally:
            _kill(procs)
        results = {}
        for path in job_dir.glob("rank-*.json"):
            data = json.loads(path.read_text())
            results[int(data["rank"])] = data
        if not error and len(results) != config.world_size:
            error = f"ranks {sorted(set(range(config.world_size)) - set(results))} wrote no result"
        loss = list(results[0]["loss"]) if 0 in results and not error else []
        return DistributedRun(
            config=config,
            per_rank_batch=per_rank_batch,
            tokens_per_sample=_tokens_per_sample(train_batch),
            loss=loss,
            ranks=_rank_results(results, config, failed, error),
            comm_measured=bool(results and all(d["comm_measured"] for d in results.values())),
            total_s=time.perf_counter() - begin,
            ok=not error,
            failed_rank=failed,
            error=error,
        )


def _launch(
    job_dir: Path, config: DistributedConfig, label: str, procs: dict[int, subprocess.Popen[bytes]]
) -> None:
    """One process per rank (or one xla_launch process for all), each in its own session."""
    launchers = [-1] if config.launch == "xla_launch" else list(range(config.world_size))
    for rank in launchers:
        env = {**os.environ, **launch_env(config, max(rank, 0)), "PYTHONPATH": str(ROOT)}
        if config.launch != "xla_launch":
            env.pop("CPU_NUM_DEVICES", None)
        command = [sys.executable, "-m", "services.executor.dist_rank", str(job_dir), str(rank)]
        if label:
            command += ["--label", label]
        with (job_dir / f"launch-{rank}.log").open("wb") as log:
            procs[rank] = subprocess.Popen(
                command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )  # fmt: skip


def _wait_for_ranks(
    job_dir: Path, config: DistributedConfig, steps: int, procs: dict[int, subprocess.Popen[bytes]]
) -> tuple[int, str]:
    """Until every rank exits 0, one fails, or the run passes its limit: (failed rank, error)."""
    limit = time.monotonic() + STARTUP_ALLOWANCE_S + config.timeout_s + steps * config.timeout_s / 10
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        bad = [(r, c) for r, c in codes.items() if c not in (None, 0)]
        if bad:
            rank, code = bad[0]
            return _failure(job_dir, procs, rank, code)
        if all(c == 0 for c in codes.values()):
            return -1, ""
        if time.monotonic() > limit:
            done = {p.stem: p.read_text() for p in job_dir.glob("rank-*.progress")}
            return -1, f"the run passed its limit and was stopped (steps per rank: {done or 'none'})"
        time.sleep(POLL_S)


def _rank_results(
    results: dict[int, Any], config: DistributedConfig, failed: int, error: str
) -> list[RankResult]:
    # the replicas of one xla_launch process fail together, each with the process's error
    together = config.launch == "xla_launch"
    return [
        RankResult(
            rank=r,
            step_seconds=list(results[r]["step_seconds"]),
            comm_seconds=list(results[r]["comm_seconds"]),
            peak_memory_bytes=int(results[r]["peak_memory_bytes"]),
            memory_source=str(results[r]["memory_source"]),
            device=str(results[r]["device"]),
        )
        if r in results
        else RankResult(
            rank=r, error=error if r == failed or together else "torn down after another rank failed"
        )
        for r in range(config.world_size)
    ]
