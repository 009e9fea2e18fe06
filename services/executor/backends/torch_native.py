"""Backends on stock PyTorch devices (cpu, cuda): modes `eager` and `compile` (inductor).

CPU and CUDA run the same code with the device changed; `torch.accelerator` covers CUDA's
synchronisation and device count. Compile mode wraps inductor in a counting backend so each
model knows how many graphs it compiled (per model, unlike dynamo's process-wide counters)
and the executor can prove no compilation happened after warm-up. Graph-break reasons come
from dynamo's counters, snapshotted around a load (loads are serialised by the runtime).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from services.executor.backends.base import (
    Availability,
    CompileCounters,
    CountingCompiler,
    DeviceDescription,
    PreparedModel,
    base_versions,
    host_memory,
)


def _dynamo_counters() -> tuple[int, tuple[str, ...], int]:
    """Dynamo's process-wide graph breaks, their reasons and frames compiled. Read only once
    something (a compile-mode load) imported dynamo: before that nothing was compiled, and
    importing it just to read zeros costs an eager executor's start several seconds (about a
    third of a CPU executor's start on a loaded 2-core host)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0, (), 0
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = dict(counters.get("graph_break", {}))
    frames: dict[str, int] = dict(counters.get("frames", {}))
    return sum(reasons.values()), tuple(sorted(reasons)), int(frames.get("total", 0))


_EXPORT_HOOKS = "torch.export._unlift"  # where torch.export's module hooks are defined


def _exported_run(module: nn.Module) -> Callable[[Sequence[torch.Tensor]], Any] | None:
    """For a torch.export program's module (`formats.load_export`): its graph's `forward`,
    called without `nn.Module.__call__` after one call through it; None for any other module.

    Each `__call__` runs torch.export's hooks in Python: a pytree match of the arguments
    against the exported signature, and a pytree registration for graph inputs that are
    modules. The shape and range guards run inside the graph (`_guards_fn`), on every call
    either way. With tensor inputs only, and the executor passing the declared inputs in the
    same order every time, the first call's match (a warm-up, at load) holds for every later
    one; skipping the hooks saves about 100 us of Python per call on small-mlp, whose batch-1
    compute is 350-550 us on this host. Outputs are the same tensors."""
    if not isinstance(module, torch.fx.GraphModule) or not hasattr(module, "_guards_fn"):
        return None  # not an exported program, or one that checks its guards in the hook
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    if any(getattr(h, "__module__", "") != _EXPORT_HOOKS for h in hooks):
        return None  # someone else's hook: keep __call__
    placeholders = module.graph.find_nodes(op="placeholder")
    if not all(isinstance(p.meta.get("val"), torch.Tensor) for p in placeholders):
        return None  # a module-typed graph input needs its pytree registration per call
    checked = False

    def run(xs: Sequence[torch.Tensor]) -> Any:
        nonlocal checked
        if checked:
            return module.forward(*xs)
        out = module(*xs)
        checked = True
        return out

    return run


def _inductor(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **kw: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, **kw)


class TorchDeviceBackend:
    """Shared implementation; subclasses set `name` and the torch device type."""

    name = "cpu"
    device_type = "cpu"
    modes: tuple[str, ...] = ("eager", "compile")
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp64")
    static_shapes = False

    def availability(self) -> Availability:
        return Availability(True)

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def describe_device(self) -> DeviceDescription:
        total, available = host_memory()
        return DeviceDescription(
            backend=self.name,
            device_type=self.device_type,
            device_name=_cpu_name(),
            device_count=1,
            memory_total_bytes=total,
            memory_available_bytes=available,
        )

    def versions(self) -> dict[str, str]:
        return {**base_versions(), "torch_threads": str(torch.get_num_threads())}

    def resource_class(self) -> str:
        return f"cpu-{os.cpu_count() or 1}core"

    def to_device(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        return module.to(device=self.device(), dtype=dtype)

    def prepare(self, module: nn.Module, mode: str) -> PreparedModel:
        if mode == "eager":
            run = _exported_run(module) or (lambda xs: module(*xs))
            return PreparedModel(run=run, module=module, mode=mode, counters=CompileCounters)
        counting = CountingCompiler(_inductor)
        compiled = torch.compile(module, backend=counting, dynamic=False)
        frames_at_start = _dynamo_counters()[2]

        def counters() -> CompileCounters:
            breaks, reasons, frames = _dynamo_counters()
            return CompileCounters(
                compilations=counting.compilations,
                compile_time_s=counting.compile_time_s,
                graph_breaks=breaks,
                graph_break_reasons=reasons,
                # every dynamo frame compile after a model's first is a recompile (new shape or guard)
                recompiles=max(0, frames - frames_at_start - 1),
            )

        return PreparedModel(run=lambda xs: compiled(*xs), module=module, mode=mode, counters=counters)

    def synchronize(self) -> None:
        if self.device_type != "cpu":
            torch.accelerator.synchronize()

    def counters(self) -> CompileCounters:
        breaks, reasons, frames = _dynamo_counters()
        return CompileCounters(graph_breaks=breaks, graph_break_reasons=reasons, recompiles=frames)

    def inference_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()


class CpuBackend(TorchDeviceBackend):
    name = "cpu"
    device_type = "cpu"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
