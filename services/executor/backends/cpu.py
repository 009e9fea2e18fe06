"""The cpu backend (main environment): eager and compile (inductor) on the host CPU."""

from __future__ import annotations

from services.executor.backends.torch_native import CpuBackend

__all__ = ["CpuBackend"]
