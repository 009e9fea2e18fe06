"""What a load is asked for and what it reports, and the phases every model's load shares.

`LoadOptions` (how to load), `PhaseTimes` (the time of each phase) and `Findings` (the
backend's compatibility findings) are the records of a load: `LoadedModel` reports them for a
tensor model, and a causal LM's generation engine for its own load, in the executor's process
or in an engine process (`generation.engine_child`), which imports this module and not
`loaded_model`. `to_device` is the first two phases of both: the checkpoint load, then the
module moved to the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.executor.backends.base import PRECISIONS, Backend, CompileCounters
from switchyard.models.registry import ModelSpec, load_module


@dataclass(frozen=True)
class LoadOptions:
    mode: str
    precision: str
    batch_buckets: tuple[int, ...]
    max_queue_delay_us: int
    max_queue_size: int
    dynamic_batching: bool
    checkpoint_sha256: str = ""


@dataclass
class PhaseTimes:
    checkpoint_load_s: float = 0.0
    to_device_s: float = 0.0
    compile_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.checkpoint_load_s + self.to_device_s + self.compile_s


@dataclass
class Findings:
    """Compatibility findings of a load (the same shape for every backend)."""

    during_load: CompileCounters = field(default_factory=CompileCounters)
    adaptations: list[str] = field(default_factory=list)
    unsupported_dtypes: list[str] = field(default_factory=list)


def to_device(spec: ModelSpec, backend: Backend, options: LoadOptions, times: PhaseTimes) -> torch.nn.Module:
    """The checkpoint loaded (verified against `options.checkpoint_sha256`) and moved to the
    backend's device in the options' precision, each phase timed into `times`."""
    start = time.perf_counter()
    module = load_module(spec, options.checkpoint_sha256)
    times.checkpoint_load_s = time.perf_counter() - start

    start = time.perf_counter()
    module = backend.to_device(module, PRECISIONS[options.precision])
    backend.synchronize()
    times.to_device_s = time.perf_counter() - start
    return module


def during_load(own: CompileCounters, process: CompileCounters) -> CompileCounters:
    """What loading compiled: the model's own compilations and recompiles, the process's graph
    breaks, fallbacks and notes (the backend's counters since the load began)."""
    return CompileCounters(
        compilations=own.compilations,
        cached_compilations=own.cached_compilations,
        compile_time_s=own.compile_time_s,
        graph_breaks=process.graph_breaks,
        graph_break_reasons=process.graph_break_reasons,
        recompiles=own.recompiles,
        fallback_ops=process.fallback_ops or own.fallback_ops,
        notes=own.notes + process.notes,
    )


def unsupported_dtypes(backend: Backend) -> list[str]:
    """Precisions this path cannot run (e.g. fp64 on TPU): a compatibility finding for trials."""
    return [p for p in PRECISIONS if p not in backend.precisions]
