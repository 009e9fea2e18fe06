"""The executor's domain: loaded models, their device thread, load and description.

No grpc here (docs/architecture.md#code-style): requests reach the models through the data
plane (`data_plane.py`), control through `control.py`; training is the Trainer it holds
(`executor_training.py`).
All device work (loading, warm-up, batches, training) runs on one device thread, so the event
loop stays free to accept, validate and queue requests while the device computes, and two
computations never overlap on the device (timings stay honest).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from services.executor.backends.base import PRECISIONS, Backend, DeviceDescription, host_id
from services.executor.batching import Batcher, BatchPolicy, QueuedRequest
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_training import Trainer
from services.executor.generation.engine_client import GenerationStream
from services.executor.generation.settings import SamplingParams
from services.executor.generation.tokenizer import load_tokenizer
from services.executor.load_phases import LoadOptions
from services.executor.loaded_model import LoadedModel
from switchyard.errors import InvalidArgument, NotFound, Unavailable
from switchyard.models.repository import ModelNotFound, Repository

log = logging.getLogger(__name__)
T = TypeVar("T")


class ModelNotLoaded(NotFound):
    """The model exists in the repository but this executor has not loaded it."""


class Draining(Unavailable):
    """The executor is shutting down and accepts no new work."""


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
        # name -> its default version, as model.toml said at the name's last load here: a
        # request for version "" reads no file (a model.toml stat per request was ~30% of a
        # small request's handler time under load)
        self.defaults: dict[str, str] = {}
        self.in_flight = 0
        self.draining = False
        self.executor_id = config.executor_id or host_id()
        self.frames_port = 0  # where framed inference listens (services.frames); 0 = not offered
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{backend.name}-device")
        self._load_lock = asyncio.Lock()
        self._device_jobs = 0
        # causal LMs' engines in processes of their own on the host CPU (generation.engine_process)
        self.engine_process = config.generation_engine == "process" and backend.name == "cpu"
        self.trainer = Trainer(self)  # training on copies of the loaded models, on the device thread

    async def on_device(self, fn: Any, *args: Any) -> Any:
        self._device_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._device, fn, *args)
        finally:
            self._device_jobs -= 1

    async def run_batch(self, model: LoadedModel, batch: list[QueuedRequest]) -> Any:
        """Queued work runs on the device thread, so the event loop keeps receiving and
        decoding the next requests while the device computes: that is how batches form under
        load. (A lone request on a quiet executor takes the data plane's inline fast path.)
        With batching off no batch can form, so a short request computes right here instead:
        a thread hand-off would only add its cost (and, for Python-heavy eager models, GIL
        contention between the loop and the device thread)."""
        if not model.options.dynamic_batching and self._inline_ok(model, batch[0].arrays, batch[0].rows):
            return model.compute(batch)
        return await self.on_device(model.compute, batch)

    def _inline_ok(self, model: LoadedModel, arrays: list[np.ndarray], rows: int) -> bool:
        return self.inline_ok(model.expected_compute_s(arrays, rows))

    def inline_ok(self, expected_s: float) -> bool:
        """May work expected to take `expected_s` run on the event loop: nothing is on the device
        thread and it is within `inline_compute_us`."""
        return self._device_jobs == 0 and expected_s <= self.inline_limit_s

    @property
    def inline_limit_s(self) -> float:
        """The longest work that may run on the event loop (`inline_compute_us`)."""
        return self.config.inline_compute_us / 1e6

    @property
    def device_idle(self) -> bool:
        """Nothing runs or waits on the device thread."""
        return self._device_jobs == 0

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

    async def load_model(self, name: str, version: str, options: LoadOptions) -> LoadedModel:
        """Loads and warms a model; replaces a loaded one of the same name and version."""
        if self.draining:
            raise Draining("executor is draining; load the model on another executor")
        spec = self.registry.get(name, version)
        self.defaults[spec.name] = self.registry.default_version(spec.name)
        options = check_options(self.backend, options)
        model = LoadedModel(spec, self.backend, options, self.engine_process)
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
            _start_serving(model, self.on_device, self.run_batch, self.inline_ok)
            old = self.models.get((spec.name, spec.version))
            self.models[(spec.name, spec.version)] = model
        if old is not None:
            await _retire(old, grace_s=30.0)  # requests already queued on the old one finish
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
        await _retire(model, grace_s=30.0)

    def find(self, name: str, version: str) -> LoadedModel:
        """The loaded model; "" version = the default version if loaded (as model.toml named it
        when a version of the name was last loaded here), else the first one loaded."""
        if version:
            model = self.models.get((name, version)) or self.loading.get((name, version))
            if model is not None:
                return model
            self.registry.get(name, version)  # NOT_FOUND for an unknown name or version
            raise ModelNotLoaded(f"model {name!r} version {version!r} is not loaded on this executor")
        loaded = [m for (n, _), m in self.models.items() if n == name]
        loaded = loaded or [m for (n, _), m in self.loading.items() if n == name]
        if not loaded:
            if name not in self.registry.names():
                raise ModelNotFound(f"unknown model {name!r}; this executor serves {self.loaded_names()}")
            raise ModelNotLoaded(f"model {name!r} is not loaded on this executor; call LoadModel first")
        default = self.defaults.get(name)
        return next((m for m in loaded if m.spec.version == default), loaded[0])

    def loaded_names(self) -> list[str]:
        return sorted({f"{n}:{v}" for n, v in self.models})

    # ---- inference (requests come through the data plane, data_plane.py) ---------------------
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
            await _retire(model)
        self._device.shutdown(wait=False, cancel_futures=True)


async def _retire(model: LoadedModel, grace_s: float = 0.0) -> None:
    """Stops serving `model`: its batcher lets queued batches finish within `grace_s`, then its
    generation engine closes."""
    if model.batcher is not None:
        await model.batcher.close(grace_s=grace_s)
    if model.engine is not None:
        await model.engine.close()


def check_options(backend: Backend, options: LoadOptions) -> LoadOptions:
    """`options` if `backend` can load with them (buckets sorted and deduplicated)."""
    if options.mode not in backend.modes:
        raise InvalidArgument(
            f"mode {options.mode!r} is not offered by backend {backend.name}; "
            f"use one of {list(backend.modes)}"
        )
    if options.precision not in PRECISIONS or options.precision not in backend.precisions:
        raise InvalidArgument(
            f"precision {options.precision!r} is not supported on {backend.name}; "
            f"use one of {list(backend.precisions)}"
        )
    buckets = tuple(sorted(set(options.batch_buckets)))
    if not buckets or buckets[0] < 1 or buckets[-1] > 1024:
        raise InvalidArgument(f"batch buckets {list(options.batch_buckets)} must be between 1 and 1024")
    if options.max_queue_size < 1 or options.max_queue_delay_us < 0:
        raise InvalidArgument("max_queue_size must be >= 1 and max_queue_delay_us >= 0")
    return LoadOptions(**{**options.__dict__, "batch_buckets": buckets})


def _start_serving(
    model: LoadedModel,
    on_device: Callable[..., Awaitable[Any]],
    run_batch: Callable[[LoadedModel, list[QueuedRequest]], Awaitable[Any]],
    inline_ok: Callable[[float], bool] | None = None,
) -> None:
    """A warmed model's batcher (and generation engine, for a causal LM); then it is READY."""
    options = model.options
    if model.generation is not None:
        tokenizer = load_tokenizer(model.generation.settings.tokenizer, model.spec.folder)
        model.engine = model.generation.serve(tokenizer, on_device, inline_ok)
    policy = BatchPolicy(
        max_batch=model.max_batch,
        max_queue_delay_us=options.max_queue_delay_us,
        max_queue_size=options.max_queue_size,
        dynamic_batching=options.dynamic_batching,
    )

    async def run(batch: list[QueuedRequest]) -> Any:
        return await run_batch(model, batch)

    model.batcher = Batcher(policy, run)
    model.state = "READY"


def find_all(executor: Executor, name: str, version: str) -> list[LoadedModel]:
    """The named model (as `Executor.find` finds it), or every loaded one where no name is given."""
    return [executor.find(name, version)] if name else list(executor.models.values())
