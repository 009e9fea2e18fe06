"""The cuda backend: the cpu code with the device changed (torch.accelerator where it fits).

Unavailable (with the reason) where torch has no CUDA or no GPU is visible. Memory and the
device name come from torch.cuda; timers stop after `torch.accelerator.synchronize()`.
"""

from __future__ import annotations

import torch

from services.executor.backends.base import Availability, DeviceDescription, base_versions
from services.executor.backends.torch_native import TorchDeviceBackend


class CudaBackend(TorchDeviceBackend):
    name = "cuda"
    device_type = "cuda"

    def availability(self) -> Availability:
        if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
            return Availability(False, f"torch {torch.__version__} was built without CUDA")
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return Availability(False, "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)")
        return Availability(True)

    def describe_device(self) -> DeviceDescription:
        avail = self.availability()
        if not avail.available:
            return DeviceDescription(self.name, "cuda", "", 0, 0, 0, False, avail.reason)
        free, total = torch.cuda.mem_get_info()
        return DeviceDescription(
            backend=self.name,
            device_type="cuda",
            device_name=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            memory_total_bytes=int(total),
            memory_available_bytes=int(free),
        )

    def versions(self) -> dict[str, str]:
        return {**base_versions(), "cuda": str(torch.version.cuda)}

    def resource_class(self) -> str:
        avail = self.availability()
        if not avail.available:
            return "gpu-unavailable"
        name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").split()[0]
        return f"gpu-{name}"
