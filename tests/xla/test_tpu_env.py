"""TorchTPU detection and mode mapping, on a host without a TPU.

What cannot run here (no TPU, no libtpu): a real TorchTPU load, warm-up and inference. These
tests cover what can: every "unavailable" reason, read from real package discovery and a
fake sysfs tree; that torch_tpu is never imported in-process (it aborts without libtpu); the
mode -> EagerMode mapping against an enum with the real member names; the sync route; and
that private counters degrade to "unknown" instead of crashing.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from services.executor.backends import tpu_env
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


@pytest.mark.parametrize(
    ("backend", "reason"),
    [("tpu", "torch_tpu is not installed"), ("xla", "torch_xla is not installed")],
)
def test_executor_refuses_to_start_with_the_reason(backend: str, reason: str) -> None:
    # the main environment has neither torch_tpu nor torch_xla: a real `serve` must say so
    done = subprocess.run(
        [sys.executable, "-m", "switchyard", "executor", "serve", "--backend", backend, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"backend {backend!r} is unavailable: {reason}" in done.stderr
    assert "Traceback" not in done.stderr


def test_backends_command_describes_tpu_as_unavailable_with_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "switchyard", "backends", "--backend", "tpu,cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 1, done.stderr  # not every requested backend can run here
    found = json.loads(done.stdout)
    assert found["cpu"]["device"]["available"] is True
    tpu = found["tpu"]
    assert tpu["device"]["available"] is False
    assert tpu["device"]["unavailable_reason"].startswith("torch_tpu is not installed")
    assert tpu["modes"] == ["strict", "debug", "defer_and_fuse", "compile"]
