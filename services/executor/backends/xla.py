"""The xla backend: torch_xla lazy tensors compiled by XLA through PJRT (CPU here, TPU on TPU VMs).

It runs only in the XLA environment (torch 2.9.0 + torch_xla 2.9.0), started with
$SWITCHYARD_XLA_PYTHON. torch_xla records each op into a lazy graph; `torch_xla.sync(wait=True)`
compiles the graph on first sight of its shape (an XLA compilation, counted as
`UncachedCompile`), runs it, and waits. So:
- shapes must be static (`static_shapes = True`): the executor pads every batch up to a warmed
  bucket, and a request with any other shape compiles a new graph, which the counters catch;
- `synchronize()` is `torch_xla.sync(wait=True)` and then `xm.wait_device_ops()`: measured on
  torch_xla 2.9 PJRT CPU, `sync(wait=True)` returns once the graph is compiled and launched,
  not executed (an mlp step: sync 2 ms, then the copy to host blocked 9 ms); only
  `wait_device_ops()` waits for execution, so the timer stops after the device finished;
- the compatibility signal is `torch_xla.debug.metrics` (see xla_compat): compilations and
  compile time, and `aten::*` ops that fell back to the host CPU.
Counters are process-wide (XLA does not attribute them to a model), which is exact here
because the executor's runtime runs one load or one batch at a time per process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
from typing import Any

import torch
from torch import nn

from services.executor.backends import tpu_env
from services.executor.backends.base import (
    Availability,
    CompileCounters,
    DeviceDescription,
    PreparedModel,
    base_versions,
    host_memory,
)
from services.executor.backends.xla_compat import TorchXlaMetrics, XlaCounters, snapshot
from switchyard.errors import InvalidArgument

STATIC_SHAPES_ADAPTATION = (
    "static shapes: batches padded up to the warmed batch buckets (XLA recompiles per shape)"
)


def to_compile_counters(counters: XlaCounters) -> CompileCounters:
    """XLA's signals in the shape every backend reports."""
    return CompileCounters(
        compilations=counters.uncached_compiles,
        cached_compilations=counters.cached_compiles,
        compile_time_s=counters.compile_time_s,
        fallback_ops=tuple(counters.fallback_ops.items()),
    )


class XlaBackend:
    name = "xla"
    modes: tuple[str, ...] = ("lazy",)
    precisions: tuple[str, ...] = ("fp32", "bf16")  # TPU; PJRT CPU also runs fp16 and fp64
    static_shapes = True

    def __init__(self) -> None:
        # PJRT_DEVICE must be set before torch_xla initialises its runtime; an explicit setting
        # wins, else TPU where the PCI bus has one, else the host CPU.
        if "PJRT_DEVICE" not in os.environ:
            os.environ["PJRT_DEVICE"] = "TPU" if tpu_env.scan_pci() else "CPU"
        self._pjrt = os.environ["PJRT_DEVICE"]
        if self._pjrt == "CPU":
            self.precisions = ("fp32", "bf16", "fp16", "fp64")
        self._txla: Any = None
        self._metrics: TorchXlaMetrics | None = None
        self._xm: Any = None

    def availability(self) -> Availability:
        if importlib.util.find_spec("torch_xla") is None:
            return Availability(
                False,
                "torch_xla is not installed in this environment; start the xla executor with the "
                "XLA environment's interpreter ($SWITCHYARD_XLA_PYTHON, built by `make setup-xla`)",
            )
        try:
            self._runtime()
        except Exception as exc:  # PJRT start-up failures surface as assorted RuntimeErrors
            return Availability(False, f"torch_xla could not start PJRT device {self._pjrt}: {exc}")
        return Availability(True)

    def _runtime(self) -> Any:
        if self._txla is None:
            self._txla = importlib.import_module("torch_xla")
            self._metrics = TorchXlaMetrics()
            self._xm = importlib.import_module("torch_xla.core.xla_model")
            self._txla.device()  # initialises the PJRT client now, not inside the first request
        return self._txla

    def device(self) -> torch.device:
        return self._runtime().device()  # type: ignore[no-any-return]

    def describe_device(self) -> DeviceDescription:
        txla = self._runtime()
        runtime = importlib.import_module("torch_xla.runtime")
        xm = importlib.import_module("torch_xla.core.xla_model")
        device = txla.device()
        hardware = str(xm.xla_device_hw(device))
        total, available = _memory(xm, device)
        name = f"{hardware} via PJRT" if hardware != "TPU" else (tpu_env.scan_pci() or ["TPU"])[0]
        return DeviceDescription(
            backend=self.name,
            device_type="xla",
            device_name=name,
            device_count=int(runtime.global_runtime_device_count()),
            memory_total_bytes=total,
            memory_available_bytes=available,
        )

    def versions(self) -> dict[str, str]:
        txla = self._runtime()
        versions = {**base_versions(), "torch_xla": str(txla.__version__), "pjrt_device": self._pjrt}
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions["libtpu"] = importlib.metadata.version("libtpu")
        return versions

    def resource_class(self) -> str:
        # XLA on PJRT CPU uses the same host cores as the cpu path, so it is priced like them.
        if self._pjrt == "CPU":
            return f"cpu-{os.cpu_count() or 1}core"
        chips = tpu_env.scan_pci()
        return "tpu-" + (chips[0].lower().replace("tpu ", "") if chips else "unknown")

    def to_device(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        moved = module.to(device=self.device(), dtype=dtype)
        self.synchronize()  # parameter uploads finish inside the to-device phase
        return moved

    def prepare(self, module: nn.Module, mode: str) -> PreparedModel:
        if mode not in self.modes:
            raise InvalidArgument(f"xla offers mode {', '.join(self.modes)}, not {mode!r}")
        # Nothing compiles here: XLA compiles each graph on the first sync of its shape, so the
        # executor's warm-up of every bucket is the compile phase. Each run syncs itself and
        # keeps the counter delta around it, so this model's counters are its own even when
        # other models load or serve in the same process (runs never overlap: one device thread).
        metrics = self._source()
        own = _Accumulator()

        def run(xs: list[torch.Tensor]) -> Any:
            before = snapshot(metrics)
            out = module(*xs)
            self.synchronize()
            own.add(snapshot(metrics).since(before))
            return out

        return PreparedModel(
            run=run,
            module=module,
            mode=mode,
            counters=lambda: to_compile_counters(own.total),
            adaptations=[STATIC_SHAPES_ADAPTATION],
        )

    def synchronize(self) -> None:
        self._runtime().sync(wait=True)
        self._xm.wait_device_ops()

    def counters(self) -> CompileCounters:
        return to_compile_counters(snapshot(self._source()))

    def _source(self) -> TorchXlaMetrics:
        self._runtime()
        assert self._metrics is not None
        return self._metrics

    def inference_context(self) -> contextlib.AbstractContextManager[Any]:
        # no_grad, not inference_mode: torch_xla's lazy tensors do not support inference tensors
        return torch.no_grad()


class _Accumulator:
    """The running sum of one model's counter deltas."""

    def __init__(self) -> None:
        self.total = XlaCounters()

    def add(self, delta: XlaCounters) -> None:
        self.total = self.total.plus(delta)


def _memory(xm: Any, device: torch.device) -> tuple[int, int]:
    """Device memory where PJRT reports it (TPU); PJRT CPU does not, so the host's memory."""
    try:
        info = xm.get_memory_info(device)
        total = int(info.get("bytes_limit", 0))
        return total, total - int(info.get("bytes_used", 0))
    except Exception:  # PJRT CPU: "GetAllocatorStats is not supported"
        return host_memory()
