"""TorchTPU detection and mode mapping, on a host without a TPU.

What cannot run here (no TPU, no libtpu): a real TorchTPU load, warm-up and inference. These
tests cover what can: every "unavailable" reason, read from real package discovery and a
fake sysfs tree; that torch_tpu is never imported in-process (it aborts without libtpu); the
mode -> EagerMode mapping against an enum with the real member names; the sync route; and
that private counters degrade to "unknown" instead of crashing.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from services.executor.backends import tpu_env
from services.executor.backends.tpu import TpuBackend
from switchyard.errors import FailedPrecondition, InvalidArgument
from tests.conftest import ROOT


class FakeEagerMode(enum.Enum):
    """The public members of torch.tpu.EagerMode in torch_tpu 0.2.0."""

    DEFER_AND_FUSE = 0
    DEFER_NEVER = 1
    DEFER_NEVER_AND_LAUNCH_BLOCKING = 2


def _fake_package(root: Path, name: str, body: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)


def _fake_pci(root: Path, devices: dict[str, tuple[str, str]]) -> Path:
    for slot, (vendor, device) in devices.items():
        (root / slot).mkdir(parents=True)
        (root / slot / "vendor").write_text(vendor + "\n")
        (root / slot / "device").write_text(device + "\n")
    return root


def test_unavailable_without_torch_tpu() -> None:
    found = tpu_env.detect(probe=False)
    assert not found.available
    assert found.reason.startswith("torch_tpu is not installed")
    assert found.versions["torch_tpu"] == "not installed"
    with pytest.raises(FailedPrecondition, match="tpu backend unavailable: torch_tpu is not installed"):
        tpu_env.require_available(found)


def test_reasons_in_order_and_torch_tpu_never_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torch_tpu that fails loudly if anyone imports it in this process.
    pkgs = tmp_path / "site"
    _fake_package(pkgs, "torch_tpu", "raise RuntimeError('imported torch_tpu in-process')\n")
    monkeypatch.syspath_prepend(str(pkgs))
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    no_tpu = _fake_pci(tmp_path / "pci0", {"0000:00:04.0": ("0x1ae0", "0x0042")})  # gVNIC

    found = tpu_env.detect(pci_root=no_tpu, probe=False)
    assert not found.available and found.reason.startswith("libtpu is not installed")
    assert "torch_tpu" not in sys.modules

    _fake_package(pkgs, "libtpu", "")
    found = tpu_env.detect(pci_root=no_tpu, probe=False)
    assert not found.available and found.reason.startswith("no TPU device on this host")

    with_tpu = _fake_pci(tmp_path / "pci1", {"0000:00:05.0": ("0x1ae0", "0x0063")})
    assert tpu_env.scan_pci(with_tpu) == ["TPU v5e"]
    assert tpu_env.detect(pci_root=with_tpu, probe=False).available

    # The final check imports torch_tpu in a child: its failure is the reason, not a crash here.
    monkeypatch.setenv("PYTHONPATH", f"{pkgs}:{Path.cwd()}")
    found = tpu_env.detect(pci_root=with_tpu, probe=True, timeout_s=60)
    assert not found.available
    assert "importing torch_tpu failed" in found.reason
    assert "imported torch_tpu in-process" in found.reason
    assert found.device_name == "TPU v5e"
    assert "torch_tpu" not in sys.modules


def test_mode_mapping_uses_eager_mode_members() -> None:
    assert tpu_env.eager_mode_for("strict", FakeEagerMode) is FakeEagerMode.DEFER_NEVER
    assert tpu_env.eager_mode_for("debug", FakeEagerMode) is FakeEagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    assert tpu_env.eager_mode_for("defer_and_fuse", FakeEagerMode) is FakeEagerMode.DEFER_AND_FUSE
    assert tpu_env.eager_mode_for("compile", FakeEagerMode) is None
    with pytest.raises(InvalidArgument, match="unknown tpu mode 'eager'; use one of strict"):
        tpu_env.eager_mode_for("eager", FakeEagerMode)

    class Older(enum.Enum):
        DEFER_NEVER = 1

    with pytest.raises(FailedPrecondition, match=r"no EagerMode\.DEFER_AND_FUSE"):
        tpu_env.eager_mode_for("defer_and_fuse", Older)


def test_mode_table_matches_the_real_wheel() -> None:
    # The member names were read from torch_tpu 0.2.0's execution_mode module; keep them exact.
    assert {v for v in tpu_env.TPU_MODES.values() if v} == {m.name for m in FakeEagerMode}


def test_sync_route_and_private_probes() -> None:
    calls: list[str] = []
    tpu = types.SimpleNamespace(
        synchronize=lambda: calls.append("tpu"),
        _get_cache_hits=lambda: 7,
        _get_cache_misses=lambda: (_ for _ in ()).throw(RuntimeError("backend not initialised")),
    )
    accel = types.SimpleNamespace(synchronize=lambda: calls.append("accelerator"))
    notes: list[str] = []
    tpu_env.synchronizer(types.SimpleNamespace(accelerator=accel, tpu=tpu), notes)()
    tpu_env.synchronizer(types.SimpleNamespace(tpu=tpu), notes)()  # torch without torch.accelerator
    assert calls == ["accelerator", "tpu"]

    values = tpu_env.probe_private(tpu, tpu_env.PRIVATE_COUNTERS, notes)
    assert values == {"_get_cache_requests": None, "_get_cache_hits": 7, "_get_cache_misses": None}
    assert any("_get_cache_requests not found: recorded unknown" in n for n in notes)
    assert any("_get_cache_misses failed (RuntimeError): recorded unknown" in n for n in notes)


def _switchyard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.parametrize(
    ("backend", "reason"),
    [("tpu", "torch_tpu is not installed"), ("xla", "torch_xla is not installed")],
)
def test_executor_refuses_to_start_with_the_reason(backend: str, reason: str) -> None:
    # the main environment has neither torch_tpu nor torch_xla: a real `serve` must say so
    done = _switchyard("executor", "serve", "--backend", backend, "--port", "0")
    assert done.returncode == 2, done.stderr
    assert f"backend {backend!r} is unavailable: {reason}" in done.stderr
    assert "Traceback" not in done.stderr


def test_backends_command_describes_tpu_as_unavailable_with_the_reason() -> None:
    done = _switchyard("backends", "--backend", "tpu,cpu")
    assert done.returncode == 1, done.stderr  # not every requested backend can run here
    found = json.loads(done.stdout)
    assert found["cpu"]["device"]["available"] is True
    tpu = found["tpu"]
    assert tpu["device"]["available"] is False
    assert tpu["device"]["unavailable_reason"].startswith("torch_tpu is not installed")
    assert tpu["modes"] == ["strict", "debug", "defer_and_fuse", "compile"]


class FakeTpu:
    """A `torch.tpu` stand-in with the names the backend uses: modes, sync, cache counters."""

    EagerMode = FakeEagerMode

    def __init__(self) -> None:
        self.mode: FakeEagerMode | None = None
        self.misses = 0
        self.seen: set[tuple[int, ...]] = set()
        self.syncs = 0

    @contextlib.contextmanager
    def set_eager_mode(self, mode: FakeEagerMode) -> Iterator[None]:
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    def synchronize(self) -> None:
        self.syncs += 1

    def _get_cache_misses(self) -> int:
        return self.misses


class ShapeCachedModule(nn.Module):
    """Counts a cache miss per new input shape, as TorchTPU's executable cache does."""

    def __init__(self, tpu: FakeTpu) -> None:
        super().__init__()
        self.tpu = tpu
        self.modes: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.tpu.mode is not None
        self.modes.append(self.tpu.mode.name)
        if tuple(x.shape) not in self.tpu.seen:
            self.tpu.seen.add(tuple(x.shape))
            self.tpu.misses += 1
        return x * 2


def test_tpu_backend_modes_sync_and_per_model_compilations() -> None:
    tpu = FakeTpu()
    ready = tpu_env.TpuDetection(True, "", {"torch_tpu": "fake"}, "TPU v5e", 1)
    backend = TpuBackend(tpu_module=tpu, detection=ready)
    assert backend.availability().available and backend.modes[0] == "strict"
    first, second = ShapeCachedModule(tpu), ShapeCachedModule(tpu)
    a = backend.prepare(first, "defer_and_fuse")
    b = backend.prepare(second, "debug")
    a.run([torch.ones(4, 2)])
    a.run([torch.ones(4, 2)])
    b.run([torch.ones(8, 2)])  # another model's miss is not this model's compilation
    assert a.counters().compilations == 1 and b.counters().compilations == 1
    a.run([torch.ones(3, 2)])
    assert a.counters().compilations == 2 and b.counters().compilations == 1
    assert first.modes == ["DEFER_AND_FUSE"] * 3 and second.modes == ["DEFER_NEVER_AND_LAUNCH_BLOCKING"]
    assert tpu.mode is None and tpu.syncs == 4  # the mode is scoped to a run; each run syncs
    assert any(a.startswith("static shapes") for a in a.adaptations)
    with pytest.raises(InvalidArgument, match="unknown tpu mode 'lazy'"):
        backend.prepare(first, "lazy")


class FakeTpuWithoutCounters(FakeTpu):
    """A torch_tpu whose private cache counters are gone (they may change without notice)."""

    _get_cache_misses = None  # type: ignore[assignment]


def test_tpu_backend_without_cache_counters_records_unknown() -> None:
    tpu = FakeTpuWithoutCounters()
    backend = TpuBackend(tpu_module=tpu, detection=tpu_env.TpuDetection(True, "", {}, "TPU", 1))
    prepared = backend.prepare(ShapeCachedModule(tpu), "strict")
    prepared.run([torch.ones(2, 2)])
    counters = prepared.counters()
    assert counters.compilations == 0
    assert "compilations: unknown" in counters.notes
    assert any("_get_cache_misses not found: recorded unknown" in n for n in counters.notes)
