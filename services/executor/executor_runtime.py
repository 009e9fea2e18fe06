"""The executor's domain: loaded models, inference, training, load and description.

No grpc here (docs/architecture.md#code-style): the servicers in `executor_servicer.py` convert
messages and call this.
All device work (loading, warm-up, batches, training) runs on one device thread, so the event
loop stays free to accept, validate and queue requests while the device computes, and two
computations never overlap on the device (timings stay honest).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.executor import distributed
from services.executor.backends.base import PRECISIONS, Backend, DeviceDescription, host_id
from services.executor.batching import Batcher, BatchPolicy, BatchResult, QueuedRequest
from services.executor.dist_launch import DistributedRun, run_distributed, split_objective
from services.executor.executor_config import ExecutorConfig
from services.executor.generation.engine import GenerationEngine, GenerationStream
from services.executor.generation.settings import SamplingParams
from services.executor.generation.tokenizer import load_tokenizer
from services.executor.loaded_model import LoadedModel, LoadOptions
from switchyard.codec import WireTensor
from switchyard.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from switchyard.models.repository import ModelNotFound, Repository

log = logging.getLogger(__name__)
T = TypeVar("T")

# The inline fast path is for a quiet executor, and "quiet" is read from the event loop's own
# thread: since the last request finished, it sat idle (waiting on the network, not running)
# for at least this long. Requests waiting inside gRPC cannot be counted from here, but they
# keep the loop busy: at 16 clients it accepts, decodes and answers calls back to back and
# never idles, so every request goes through the batcher and the device thread, where
# batches form while the loop takes in the next ones. A lone client's next request leaves the
# loop idle for the client's whole turn (its decode, its next request, the loopback), well
# over this. (A gap in wall time alone cannot tell the two apart: under load gRPC's own work
# between two handlers takes as long as a lone client's round trip.)
LOOP_IDLE_S = 100e-6
INLINE_LOOK_TURNS = 3


class ModelNotLoaded(NotFound):
    """The model exists in the repository but this executor has not loaded it."""


class Draining(Unavailable):
    """The executor is shutting down and accepts no new work."""


@dataclass(frozen=True)
class TrainResult:
    loss: list[float]
    step_seconds: list[float]
    total_s: float


@dataclass(frozen=True)
class Description:
    device: DeviceDescription
    torch_version: str
    versions: dict[str, str]
    resource_class: str
    price_key: str
    host: str
    modes: tuple[str, ...]


@dataclass(frozen=True)
class Load:
    in_flight: int
    queue_depth: int
    draining: bool


class Executor:
    def __init__(self, config: ExecutorConfig, backend: Backend, registry: Repository) -> None:
        self.config = config
        self.backend = backend
        self.registry = registry
        self.models: dict[tuple[str, str], LoadedModel] = {}
        self.loading: dict[tuple[str, str], LoadedModel] = {}  # first loads in progress
        self.in_flight = 0
        self.draining = False
        self.executor_id = config.executor_id or host_id()
        self.frames_port = 0  # where framed inference listens (switchyard.frames); 0 = not offered
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{backend.name}-device")
        self._load_lock = asyncio.Lock()
        self._device_jobs = 0
        self._last_done = 0.0  # time.perf_counter() when the last request left `infer`
        self._last_done_cpu = 0.0  # time.thread_time() of the loop's thread then

    async def on_device(self, fn: Any, *args: Any) -> Any:
        self._device_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._device, fn, *args)
        finally:
            self._device_jobs -= 1

    async def run_batch(self, model: LoadedModel, batch: list[QueuedRequest]) -> Any:
        """Queued work runs on the device thread, so the event loop keeps receiving and
        decoding the next requests while the device computes: that is how batches form under
        load. (A lone request on a quiet executor takes the inline fast path in `infer`.)
        With batching off no batch can form, so a short request computes right here instead:
        a thread hand-off would only add its cost (and, for Python-heavy eager models, GIL
        contention between the loop and the device thread)."""
        if not model.options.dynamic_batching and self._inline_ok(model, batch[0].rows):
            return model.compute(batch)
        return await self.on_device(model.compute, batch)

    def _inline_ok(self, model: LoadedModel, rows: int) -> bool:
        limit = self.config.inline_compute_us / 1e6
        return self._device_jobs == 0 and model.expected_compute_s(rows) <= limit

    # ---- models -------------------------------------------------------------------------
    def default_options(self, name: str = "", version: str = "") -> LoadOptions:
        """The executor's settings; a named model's model.toml [batching] replaces the buckets
        and queue delay it declares."""
        c = self.config
        buckets, delay = c.batch_buckets, c.max_queue_delay_us
        if name:
            batching = self.registry.get(name, version).manifest.batching
            buckets = batching.buckets or buckets
            delay = batching.max_queue_delay_us if batching.max_queue_delay_us >= 0 else delay
        return LoadOptions(
            mode=c.mode or self.backend.modes[0],
            precision=c.precision,
            batch_buckets=buckets,
            max_queue_delay_us=delay,
            max_queue_size=c.max_queue_size,
            dynamic_batching=c.dynamic_batching,
        )

    def check_options(self, options: LoadOptions) -> LoadOptions:
        if options.mode not in self.backend.modes:
            raise InvalidArgument(
                f"mode {options.mode!r} is not offered by backend {self.backend.name}; "
                f"use one of {list(self.backend.modes)}"
            )
        if options.precision not in PRECISIONS or options.precision not in self.backend.precisions:
            raise InvalidArgument(
                f"precision {options.precision!r} is not supported on {self.backend.name}; "
                f"use one of {list(self.backend.precisions)}"
            )
        buckets = tuple(sorted(set(options.batch_buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > 1024:
            raise InvalidArgument(f"batch buckets {list(options.batch_buckets)} must be between 1 and 1024")
        if options.max_queue_size < 1 or options.max_queue_delay_us < 0:
            raise InvalidArgument("max_queue_size must be >= 1 and max_queue_delay_us >= 0")
        return LoadOptions(**{**options.__dict__, "batch_buckets": buckets})

    async def load_model(self, name: str, version: str, options: LoadOptions) -> LoadedModel:
        """Loads and warms a model; replaces a loaded one of the same name and version."""
        if self.draining:
            raise Draining("executor is draining; load the model on another executor")
        spec = self.registry.get(name, version)
        options = self.check_options(options)
        model = LoadedModel(spec, self.backend, options)
        key = (spec.name, spec.version)
        async with self._load_lock:
            first = key not in self.models  # a reload keeps serving the old one meanwhile
            if first:
                self.loading[key] = model  # visible as LOADING (ModelReady false) until warmed
            try:
                await self.on_device(model.load)
            except Exception as exc:
                model.state, model.error = "FAILED", str(exc)
                log.warning("loading %s:%s failed: %s", spec.name, spec.version, exc)
                raise
            finally:
                self.loading.pop(key, None)
            if model.generation is not None:
                tokenizer = load_tokenizer(model.generation.settings.tokenizer, spec.folder)
                model.engine = GenerationEngine(model.generation, tokenizer, self.on_device)
            policy = BatchPolicy(
                max_batch=model.max_batch,
                max_queue_delay_us=options.max_queue_delay_us,
                max_queue_size=options.max_queue_size,
                dynamic_batching=options.dynamic_batching,
            )

            async def run_batch(batch: list[QueuedRequest]) -> Any:
                return await self.run_batch(model, batch)

            model.batcher = Batcher(policy, run_batch)
            model.state = "READY"
            old = self.models.get((spec.name, spec.version))
            self.models[(spec.name, spec.version)] = model
        if old is not None and old.batcher is not None:
            await old.batcher.close(grace_s=30.0)  # requests already queued on the old one finish
        if old is not None and old.engine is not None:
            await old.engine.close()
        log.info(
            "loaded %s:%s mode=%s precision=%s buckets=%s in %.2fs",
            spec.name, spec.version, options.mode, options.precision, list(options.batch_buckets),
            model.times.total_s,
        )  # fmt: skip
        return model

    async def unload(self, name: str, version: str) -> None:
        model = self.find(name, version)
        del self.models[(model.spec.name, model.spec.version)]
        model.state = "UNLOADED"
        if model.batcher is not None:
            await model.batcher.close(grace_s=30.0)
        if model.engine is not None:
            await model.engine.close()

    def find(self, name: str, version: str) -> LoadedModel:
        """The loaded model; "" version = the default version if loaded, else the only one."""
        if version:
            model = self.models.get((name, version)) or self.loading.get((name, version))
            if model is not None:
                return model
            self.registry.get(name, version)  # NOT_FOUND for an unknown name or version
            raise ModelNotLoaded(f"model {name!r} version {version!r} is not loaded on this executor")
        loaded = [m for (n, _), m in self.models.items() if n == name]
        if len(loaded) == 1:
            # the default version if loaded, else the only one: this one either way, without
            # reading the repository (a model.toml stat per request was ~30% of a small
            # request's handler time under load)
            return loaded[0]
        loaded = loaded or [m for (n, _), m in self.loading.items() if n == name]
        if not loaded:
            if name not in self.registry.names():
                raise ModelNotFound(f"unknown model {name!r}; this executor serves {self.loaded_names()}")
            raise ModelNotLoaded(f"model {name!r} is not loaded on this executor; call LoadModel first")
        default = self.registry.default_version(name)
        return next((m for m in loaded if m.spec.version == default), loaded[0])

    def loaded_names(self) -> list[str]:
        return sorted({f"{n}:{v}" for n, v in self.models})

    # ---- inference -----------------------------------------------------------------------
    async def infer(
        self, name: str, version: str, inputs: list[WireTensor], deadline: float | None
    ) -> tuple[LoadedModel, BatchResult]:
        """`deadline` is in time.perf_counter() seconds; work still queued then is dropped."""
        if self.draining:
            raise Draining("executor is draining; retry on another executor")
        model = self.find(name, version)
        if model.state != "READY" or model.batcher is None:
            raise Unavailable(f"model {name!r} is {model.state}; retry when it is READY")
        arrays, rows = model.validate(inputs)
        batcher = model.batcher
        # wall time since the last request finished, less what the loop's thread ran meanwhile
        idle = (time.perf_counter() - self._last_done) - (time.thread_time() - self._last_done_cpu)
        quiet = idle > LOOP_IDLE_S
        self.in_flight += 1
        try:
            if quiet and self.in_flight == 1 and batcher.idle and self._inline_ok(model, rows):
                # Requests that reached gRPC while the loop was busy show up within a few loop
                # turns; counted in flight, this one makes them queue rather than go inline.
                for _ in range(INLINE_LOOK_TURNS):
                    await asyncio.sleep(0)
                if self.in_flight == 1 and batcher.idle and self._device_jobs == 0:
                    # Alone and short: compute right here; queue and thread hand-offs cost more.
                    return model, batcher.run_now(arrays, rows, model.compute)
            return model, await batcher.submit(arrays, rows, deadline)
        finally:
            self.in_flight -= 1
            self._last_done = time.perf_counter()
            self._last_done_cpu = time.thread_time()

    def generate(
        self,
        model: LoadedModel,
        prompt: list[int],
        params: SamplingParams,
        with_text: bool,
        deadline: float | None,
    ) -> GenerationStream:
        """Starts a generation on a causal LM (see `generation.engine`); iterate the stream."""
        if self.draining:
            raise Draining("executor is draining; retry on another executor")
        if model.state != "READY" or model.engine is None:
            raise Unavailable(f"model {model.spec.name!r} is {model.state}; retry when it is READY")
        return model.engine.submit(prompt, params, with_text, deadline)

    def load(self) -> Load:
        depth = sum(m.batcher.depth for m in self.models.values() if m.batcher is not None)
        depth += sum(m.engine.depth for m in self.models.values() if m.engine is not None)
        return Load(in_flight=self.in_flight, queue_depth=depth, draining=self.draining)

    def ready(self) -> bool:
        return (
            not self.draining and not self.loading and all(m.state == "READY" for m in self.models.values())
        )

    # ---- training ------------------------------------------------------------------------
    async def train(
        self, name: str, version: str, steps: int, lr: float, seed: int, batch_size: int
    ) -> TrainResult:
        model = self.find(name, version)
        if model.spec.train_loss is None:
            raise FailedPrecondition(
                f"model {model.spec.name!r} has no training objective; train mlp or tiny-lm"
            )
        if not 1 <= steps <= 10_000 or not 1 <= batch_size <= 1024 or not lr > 0:
            raise InvalidArgument("steps must be 1..10000, batch_size 1..1024 and lr > 0")
        return await self.on_device(self._train, model, steps, lr, seed, batch_size)  # type: ignore[no-any-return]

    def _train(self, model: LoadedModel, steps: int, lr: float, seed: int, batch_size: int) -> TrainResult:
        """Trains a copy of the loaded weights so serving is not changed by training."""
        assert model.prepared is not None and model.spec.train_loss is not None
        module = copy.deepcopy(model.prepared.module).train()
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        device = self.backend.device()
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
            self.backend.synchronize()
            losses.append(float(loss.detach().to("cpu", torch.float64)))
            seconds.append(time.perf_counter() - start)
        return TrainResult(losses, seconds, time.perf_counter() - begin)

    async def train_distributed(
        self, name: str, version: str, steps: int, lr: float, seed: int, world_size: int,
        strategy: str, per_rank_batch: int, timeout_s: float, label: str = "",
    ) -> DistributedRun:  # fmt: skip
        """Trains a copy of the loaded weights across `world_size` ranks this executor starts.

        Runs on the device thread, so nothing else computes on this executor meanwhile. A rank's
        failure comes back in the result (ok false, the rank and its error), not as an error.
        """
        model = self.find(name, version)
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
        config = distributed.plan(self.backend.name, world_size, strategy, timeout_s)
        assert model.prepared is not None
        module = model.prepared.module

        def run() -> DistributedRun:
            return run_distributed(
                module, train_batch, batch_loss, model.dtype, config, steps, lr, seed,
                per_rank_batch, label,
            )  # fmt: skip

        return await self.on_device(run)  # type: ignore[no-any-return]

    # ---- description -------------------------------------------------------------------
    def describe(self) -> Description:
        resource_class = self.backend.resource_class()
        return Description(
            device=self.backend.describe_device(),
            torch_version=torch.__version__,
            versions=self.backend.versions(),
            resource_class=resource_class,
            price_key=self.config.price_key or f"{self.backend.name}/{resource_class}",
            host=host_id(),
            modes=self.backend.modes,
        )

    async def close(self) -> None:
        for model in list(self.models.values()):
            if model.batcher is not None:
                await model.batcher.close()
            if model.engine is not None:
                await model.engine.close()
        self._device.shutdown(wait=False, cancel_futures=True)
