"""The Backend protocol: what an accelerator path provides to the executor.

The executor's domain code (runtime, batching) is device-neutral; everything that differs per
path sits behind this protocol. `services/executor/device.py` finds a backend by name and
imports its module lazily (torch_xla and torch_tpu exist only in their own environments).

A backend must:
- say whether it is available here, and why not (`availability`);
- name its torch device, modes and precisions; report device, versions, resource class;
- move a module to its device and prepare it for a mode (`prepare`, e.g. torch.compile);
- `synchronize()` so timers stop only after the device finished;
- snapshot its compile/fallback counters (`counters`) so the executor can report what a load
  compiled and prove nothing compiled after warm-up (`CompileCounters.since`);
- say whether shapes must be static (`static_shapes`): then every batch is padded up to a
  warmed bucket, because any new shape recompiles.
"""

from __future__ import annotations

import contextlib
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

# Precision names a LoadModel request may use -> torch dtype of float weights and activations.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""  # why not, when unavailable (what to install or where to run)


@dataclass(frozen=True)
class DeviceDescription:
    backend: str
    device_type: str
    device_name: str
    device_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    available: bool = True
    unavailable_reason: str = ""


@dataclass(frozen=True)
class CompileCounters:
    """A snapshot of a backend's compilation signals; subtract two with `since`."""

    compilations: int = 0
    cached_compilations: int = 0  # graphs found in the compilation cache instead (XLA)
    compile_time_s: float = 0.0
    graph_breaks: int = 0
    graph_break_reasons: tuple[str, ...] = ()
    recompiles: int = 0
    fallback_ops: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = ()

    def since(self, earlier: CompileCounters) -> CompileCounters:
        before = dict(earlier.fallback_ops)
        fallbacks = tuple(
            (op, n - before.get(op, 0)) for op, n in self.fallback_ops if n - before.get(op, 0) > 0
        )
        old_reasons = set(earlier.graph_break_reasons)
        return CompileCounters(
            compilations=self.compilations - earlier.compilations,
            cached_compilations=self.cached_compilations - earlier.cached_compilations,
            compile_time_s=self.compile_time_s - earlier.compile_time_s,
            graph_breaks=self.graph_breaks - earlier.graph_breaks,
            graph_break_reasons=tuple(r for r in self.graph_break_reasons if r not in old_reasons),
            recompiles=self.recompiles - earlier.recompiles,
            fallback_ops=fallbacks,
            notes=self.notes,
        )


@dataclass
class PreparedModel:
    """A module ready to run on the backend's device in one mode.

    `run(inputs)` takes device tensors in the model's declared input order and returns a
    tensor or a tuple in output order. `counters()` gives this model's own signals where the
    backend can separate them per model (else the process-wide snapshot).
    """

    run: Callable[[list[torch.Tensor]], Any]
    module: nn.Module
    mode: str
    counters: Callable[[], CompileCounters]
    adaptations: list[str] = field(default_factory=list)


@runtime_checkable
class Backend(Protocol):
    name: str  # cpu | cuda | xla | tpu
    modes: tuple[str, ...]  # first one is the default
    precisions: tuple[str, ...]
    static_shapes: bool

    def availability(self) -> Availability: ...

    def device(self) -> torch.device: ...

    def describe_device(self) -> DeviceDescription: ...

    def versions(self) -> dict[str, str]: ...

    def resource_class(self) -> str: ...

    def to_device(self, module: nn.Module, dtype: torch.dtype) -> nn.Module: ...

    def prepare(self, module: nn.Module, mode: str) -> PreparedModel: ...

    def synchronize(self) -> None: ...

    def counters(self) -> CompileCounters: ...

    def inference_context(self) -> contextlib.AbstractContextManager[Any]: ...


def host_id() -> str:
    """The host identity: paths on one host never measure at the same time (docs/architecture.md#trials)."""
    return socket.gethostname()


def base_versions() -> dict[str, str]:
    import numpy

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def host_memory() -> tuple[int, int]:
    """The host's total and available memory from /proc/meminfo; (0, 0) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemTotal", 0), info.get("MemAvailable", 0)
    except OSError:
        return 0, 0


class CountingCompiler:
    """A torch.compile backend around `inner` (inductor, TorchTPU's own), counting compilations
    and their time per model (dynamo's own counters are process-wide)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self._inner = inner
        self.compilations = 0
        self.compile_time_s = 0.0
        self._lock = threading.Lock()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **kw: Any) -> Any:
        start = time.perf_counter()
        compiled = self._inner(gm, example_inputs, **kw)
        with self._lock:
            self.compilations += 1
            self.compile_time_s += time.perf_counter() - start
        return compiled
