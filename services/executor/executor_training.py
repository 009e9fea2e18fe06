"""Training on an executor: a copy of a loaded model's weights, on the device thread (so serving
is not changed and nothing else computes meanwhile), or across ranks this executor starts
(services/executor/dist_launch.py).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.executor import distributed
from services.executor.backends.base import Backend
from services.executor.dist_launch import DistributedRun, run_distributed, split_objective
from services.executor.loaded_model import LoadedModel
from services.executor.training_optim import momentum_sgd
from switchyard.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class TrainResult:
    loss: list[float]
    step_seconds: list[float]
    total_s: float


class _Executor(Protocol):
    """What training needs of the Executor that holds it: its models and its device thread."""

    backend: Backend

    def find(self, name: str, version: str) -> LoadedModel: ...

    async def on_device(self, fn: Any, *args: Any) -> Any: ...


class Trainer:
    """An executor's training: held by the Executor, whose models and device thread it uses."""

    def __init__(self, executor: _Executor) -> None:
        self.executor = executor

    async def train(
        self, name: str, version: str, steps: int, lr: float, seed: int, batch_size: int
    ) -> TrainResult:
        executor = self.executor
        model = executor.find(name, version)
        if model.spec.train_loss is None:
            raise FailedPrecondition(
                f"model {model.spec.name!r} has no training objective; train mlp or tiny-lm"
            )
        if not 1 <= steps <= 10_000 or not 1 <= batch_size <= 1024 or not lr > 0:
            raise InvalidArgument("steps must be 1..10000, batch_size 1..1024 and lr > 0")
        return await executor.on_device(_train_copy, executor.backend, model, steps, lr, seed, batch_size)  # type: ignore[no-any-return]

    async def train_distributed(
        self, name: str, version: str, steps: int, lr: float, seed: int, world_size: int,
        strategy: str, per_rank_batch: int, timeout_s: float, label: str = "",
    ) -> DistributedRun:  # fmt: skip
        """Trains a copy of the loaded weights across `world_size` ranks this executor starts.

        Runs on the device thread, so nothing else computes on this executor meanwhile. A rank's
        failure comes back in the result (ok false, the rank and its error), not as an error.
        """
        model = self.executor.find(name, version)
        spec = model.spec
        objective = split_objective(spec.train_loss)
        if objective is None:
            raise FailedPrecondition(
                f"model {spec.name!r} has no distributed training objective (train_batch and "
                "batch_loss beside its train_loss); train mlp or tiny-lm"
            )
        train_batch, batch_loss = objective
        if not 1 <= steps <= 10_000 or not 1 <= per_rank_batch <= 1024 or not lr > 0:
            raise InvalidArgument("steps must be 1..10000, per_rank_batch 1..1024 and lr > 0")
        config = distributed.plan(self.executor.backend.name, world_size, strategy, timeout_s)
        assert model.prepared is not None
        module = model.prepared.module

        def run() -> DistributedRun:
            return run_distributed(
                module, train_batch, batch_loss, model.dtype, config, steps, lr, seed,
                per_rank_batch, label,
            )  # fmt: skip

        return await self.executor.on_device(run)  # type: ignore[no-any-return]


def _train_copy(
    backend: Backend, model: LoadedModel, steps: int, lr: float, seed: int, batch_size: int
) -> TrainResult:
    """Trains a copy of the loaded weights so serving is not changed by training."""
    assert model.prepared is not None and model.spec.train_loss is not None
    module = copy.deepcopy(model.prepared.module).train()
    optimizer = momentum_sgd(module, lr)
    backend.synchronize()  # the zero momentum buffers become device data before step 1
    device = backend.device()
    losses: list[float] = []
    seconds: list[float] = []
    begin = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        # the same seeded batch every step: a curve that must fall on every correct path
        generator = torch.Generator().manual_seed(seed)
        loss = model.spec.train_loss(module, batch_size, generator, model.dtype, device)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        backend.synchronize()
        losses.append(float(loss.detach().to("cpu", torch.float64)))
        seconds.append(time.perf_counter() - start)
    return TrainResult(losses, seconds, time.perf_counter() - begin)
