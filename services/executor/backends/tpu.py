"""The tpu backend: TorchTPU (`torch_tpu`, the PyTorch-native `tpu` device) on TPU VMs.

It runs in its own environment (torch >= 2.11 + torch_tpu + libtpu, requirements/tpu.txt) and
only on a TPU host. Everything that decides whether it can run lives in `tpu_env`, which never
imports torch_tpu in-process before it is known to be safe (a host without libtpu aborts on
import). Modes (docs/architecture.md#backends):
- `strict`  -> torch.tpu.EagerMode.DEFER_NEVER: every op dispatched eagerly;
- `debug`   -> DEFER_NEVER_AND_LAUNCH_BLOCKING: eager and blocking, errors at their op;
- `defer_and_fuse` -> DEFER_AND_FUSE: ops are deferred and fused into larger executables;
- `compile` -> torch.compile(backend="tpu") through a counting wrapper, eager ops strict.
Compile signals: compilations counted by the wrapper (compile mode); the runtime's
compilation-cache misses, hits and requests come from private classmethods and are
"unknown" when this torch_tpu lacks them. Without a TPU none of this runs: `availability()`
says why and the executor refuses to start.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from services.executor.backends import base, tpu_env

STATIC_SHAPES_ADAPTATION = (
    "static shapes: batches padded up to the warmed batch buckets (one executable per shape)"
)


class TpuBackend:
    name = "tpu"
    modes: tuple[str, ...] = tuple(tpu_env.TPU_MODES)  # strict first: the default
    precisions: tuple[str, ...] = ("fp32", "bf16")
    static_shapes = True

    def __init__(self, tpu_module: Any = None, detection: tpu_env.TpuDetection | None = None) -> None:
        """Both arguments are for tests without a TPU (a fake `torch.tpu`); the executor passes none."""
        self._detection = detection
        self._tpu: Any = tpu_module
        self._notes: list[str] = []
        self._sync: Any = None if tpu_module is None else tpu_module.synchronize

    def availability(self) -> base.Availability:
        if self._detection is None:
            self._detection = tpu_env.detect()
        return base.Availability(self._detection.available, self._detection.reason)

    def _module(self) -> Any:
        """torch.tpu, imported only once detection said the host can run it."""
        if self._tpu is None:
            tpu_env.require_available(self._detection or tpu_env.detect())
            importlib.import_module("torch_tpu")
            self._tpu = torch.tpu  # type: ignore[attr-defined]
            self._sync = tpu_env.synchronizer(torch, self._notes)
        return self._tpu

    def device(self) -> torch.device:
        return torch.device("tpu")

    def describe_device(self) -> base.DeviceDescription:
        found = self._detection or tpu_env.detect()
        self._detection = found
        total = 0
        if found.available:
            try:  # experimental in torch_tpu 0.2.0 (HBM per device from the chip generation)
                total = int(self._module().get_device_properties(0).total_memory)
            except Exception as exc:  # unknown generation or a changed API: unknown, not a crash
                self._notes.append(f"device memory unknown ({type(exc).__name__})")
        return base.DeviceDescription(
            backend=self.name,
            device_type="tpu",
            device_name=found.device_name,
            device_count=found.device_count,
            memory_total_bytes=total,
            memory_available_bytes=0,  # torch_tpu 0.2.0 has no public free-memory query
            available=found.available,
            unavailable_reason=found.reason,
        )

    def versions(self) -> dict[str, str]:
        found = self._detection or tpu_env.detect()
        return {**base.base_versions(), **found.versions}

    def resource_class(self) -> str:
        name = (self._detection.device_name if self._detection else "") or "unknown"
        return "tpu-" + name.lower().replace("tpu ", "")

    def to_device(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        self._module()
        moved = module.to(device=self.device(), dtype=dtype)
        self.synchronize()
        return moved

    def prepare(self, module: nn.Module, mode: str) -> base.PreparedModel:
        tpu = self._module()
        member = tpu_env.eager_mode_for(mode, tpu.EagerMode)
        eager = member if member is not None else getattr(tpu.EagerMode, tpu_env.COMPILE_EAGER_FALLBACK)
        if member is not None:
            fn: Any = module
            counting: base.CountingCompiler | None = None
        else:
            from torch._dynamo.backends.registry import lookup_backend

            counting = base.CountingCompiler(lookup_backend("tpu"))
            fn = torch.compile(module, backend=counting, dynamic=False)

        # The runtime's cache counters are process-wide; each run syncs and keeps the miss
        # delta around it, so a model's count is its own (runs never overlap: one device thread).
        own_misses = [0]

        def run(xs: list[torch.Tensor]) -> Any:
            before = self._misses()
            with tpu.set_eager_mode(eager):
                out = fn(*xs)
            self.synchronize()
            after = self._misses()
            if before is not None and after is not None:
                own_misses[0] += after - before
            return out

        def counters() -> base.CompileCounters:
            device = self.counters()
            if counting is not None:  # compile mode: the graphs torch.compile built for this model
                return base.CompileCounters(
                    compilations=counting.compilations,
                    compile_time_s=counting.compile_time_s,
                    notes=device.notes,
                )
            return base.CompileCounters(compilations=own_misses[0], notes=device.notes)

        return base.PreparedModel(
            run=run, module=module, mode=mode, counters=counters, adaptations=[STATIC_SHAPES_ADAPTATION]
        )

    def synchronize(self) -> None:
        self._module()
        self._sync()

    def _misses(self) -> int | None:
        value = tpu_env.probe_private(self._module(), ("_get_cache_misses",), [])["_get_cache_misses"]
        return value

    def counters(self) -> base.CompileCounters:
        tpu = self._module()
        notes: list[str] = []
        values = tpu_env.probe_private(tpu, tpu_env.PRIVATE_COUNTERS, notes)
        misses = values.get("_get_cache_misses")
        return base.CompileCounters(
            # a cache miss is a new executable: the eager modes' compilation count
            compilations=misses if misses is not None else 0,
            notes=tuple(self._notes + notes + ([] if misses is not None else ["compilations: unknown"])),
        )

    def inference_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.no_grad()
