"""Device selection: the one place that maps a path name to its backend (docs/architecture.md#processes).

Backends are registered by import path and imported only when selected, because torch_xla
and torch_tpu exist only in their own environments. Every other executor module works with
the `Backend` protocol and never names a device.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from services.executor.backends.base import Availability, Backend
from switchyard.errors import FailedPrecondition, InvalidArgument

# backend name -> "module:Class"; xla and tpu are implemented by their owners (issue 3).
BACKENDS: dict[str, str] = {
    "cpu": "services.executor.backends.cpu:CpuBackend",
    "cuda": "services.executor.backends.cuda:CudaBackend",
    "xla": "services.executor.backends.xla:XlaBackend",
    "tpu": "services.executor.backends.tpu:TpuBackend",
}


class BackendUnavailable(FailedPrecondition):
    """The backend exists but cannot run here (missing package or device)."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    availability: Availability


def load_backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise InvalidArgument(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be imported here: {exc}") from None
    cls: type[Backend] = getattr(module, attr)
    return cls


def select_backend(name: str, cpu_threads: int = 0) -> Backend:
    """Instantiates the named backend; raises BackendUnavailable with the reason if it can't run.

    `cpu_threads` sets torch's intra-op threads (0 = one fewer than the cores, at least 1):
    the gRPC event loop needs a core of its own, and an oversubscribed OpenMP pool on a busy
    host is many times slower than one thread.
    """
    backend = load_backend_class(name)()
    availability = backend.availability()
    if not availability.available:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {availability.reason}")
    import os

    import torch

    torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 1) - 1))
    return backend


def probe(name: str) -> BackendChoice:
    """Availability of a backend without raising (for `describe` listings)."""
    try:
        return BackendChoice(name, load_backend_class(name)().availability())
    except (BackendUnavailable, InvalidArgument) as exc:
        return BackendChoice(name, Availability(False, str(exc)))
