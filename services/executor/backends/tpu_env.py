"""TorchTPU detection, mode mapping and defensive probes, without importing torch_tpu blindly.

Read from the real `torch-tpu` 0.2.0 wheel (not from memory):
- `import torch_tpu` on a host without libtpu does not raise: the PJRT plugin registration
  hits an absl CHECK (`TPU_LIBRARY_PATH is not set`) and aborts the whole process. So
  detection never imports torch_tpu in-process; it checks the package, torch version,
  libtpu and the PCI bus first, and the final import is a probe in a child process.
- torch_tpu requires torch >= 2.11; from torch 2.11 on `torch.tpu.is_available()` and
  `torch.tpu.synchronize()` are "internal" and raise RuntimeError when called from user code
  (unless TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS=1); `torch.accelerator.*` is the public route.
- `torch.tpu.EagerMode` has DEFER_AND_FUSE, DEFER_NEVER, DEFER_NEVER_AND_LAUNCH_BLOCKING;
  `torch.tpu.set_eager_mode(mode)` is a context manager, `torch.tpu.eager_mode` a property.
- compilation-cache counters exist only as private classmethods (`torch.tpu._get_cache_misses`
  and friends); they are probed and recorded as unknown when missing or failing.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from switchyard.errors import FailedPrecondition, InvalidArgument

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of TPU chips (torch_tpu/_internal/utils/hardware.py); Google's vendor id
# also covers gVNIC network cards, so the vendor alone does not mean a TPU.
TPU_PCI_DEVICES: Mapping[str, str] = {
    "0x005e": "TPU v4",
    "0x0062": "TPU v5p",
    "0x0063": "TPU v5e",
    "0x006f": "TPU v6e",
    "0x0076": "TPU v7",
}
MIN_TORCH = (2, 11)

# switchyard mode -> torch.tpu.EagerMode member (None: torch.compile(backend="tpu")).
TPU_MODES: Mapping[str, str | None] = {
    "strict": "DEFER_NEVER",
    "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING",
    "defer_and_fuse": "DEFER_AND_FUSE",
    "compile": None,
}
# Ops outside compiled graphs still dispatch eagerly; strict keeps them unfused and visible.
COMPILE_EAGER_FALLBACK = "DEFER_NEVER"

PRIVATE_COUNTERS = ("_get_cache_requests", "_get_cache_hits", "_get_cache_misses")

_PROBE = (
    "import json, torch, torch_tpu\n"
    "acc = torch.accelerator.current_accelerator()\n"
    "print(json.dumps({'accelerator': acc.type if acc else '',"
    " 'count': torch.accelerator.device_count()}))\n"
)


@dataclasses.dataclass(frozen=True)
class TpuDetection:
    """Whether this environment can run TorchTPU, and if not, the first reason why."""

    available: bool
    reason: str
    versions: Mapping[str, str]
    device_name: str = ""
    device_count: int = 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def scan_pci(root: Path = Path("/sys/bus/pci/devices")) -> list[str]:
    """Names of the TPU chips on the PCI bus (reads sysfs only; initialises nothing)."""
    chips: list[str] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return chips
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text().strip()
            device = (entry / "device").read_text().strip()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES:
            chips.append(TPU_PCI_DEVICES[device])
    return chips


def _libtpu_present() -> bool:
    if importlib.util.find_spec("libtpu") is not None:
        return True
    path = os.environ.get("TPU_LIBRARY_PATH", "")
    return bool(path) and Path(path).is_file()


def _probe_import(python: str, timeout_s: float) -> tuple[int, str]:
    """Imports torch_tpu in a child process, since a bad setup aborts the importer."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return -1, f"importing torch_tpu took over {timeout_s:.0f}s"
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        return -1, f"importing torch_tpu failed (exit {done.returncode}): {tail[0][:300]}"
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return -1, f"torch_tpu probe printed no result: {done.stdout[-200:]!r}"
    if info.get("accelerator") != "tpu" or int(info.get("count", 0)) < 1:
        return -1, f"torch_tpu imported but torch.accelerator reports {info}"
    return int(info["count"]), ""


def detect(
    *,
    pci_root: Path = Path("/sys/bus/pci/devices"),
    probe: bool = True,
    python: str = sys.executable,
    timeout_s: float = 120.0,
) -> TpuDetection:
    """Checks, cheapest first, everything TorchTPU needs; stops at the first missing piece."""
    torch_version = _version("torch") or "not installed"
    tt_version = _version("torch-tpu") or _version("torch_tpu")
    versions = {
        "torch": torch_version,
        "torch_tpu": tt_version or "not installed",
        "libtpu": _version("libtpu") or "not installed",
        "python": sys.version.split()[0],
    }

    def no(reason: str, chips: list[str] | None = None) -> TpuDetection:
        return TpuDetection(False, reason, versions, chips[0] if chips else "", len(chips or []))

    if importlib.util.find_spec("torch_tpu") is None:
        return no(
            "torch_tpu is not installed in this environment "
            "(TorchTPU runs in its own env on TPU VMs: `make setup-tpu`, then $SWITCHYARD_TPU_PYTHON)"
        )
    if _major_minor(torch_version) < MIN_TORCH:
        return no(f"torch_tpu needs torch >= 2.11, this environment has torch {torch_version}")
    if not _libtpu_present():
        return no(
            "libtpu is not installed and TPU_LIBRARY_PATH is unset "
            "(importing torch_tpu without it aborts the process)"
        )
    chips = scan_pci(pci_root)
    if not chips:
        return no("no TPU device on this host (no Google TPU chip on the PCI bus)")
    if probe:
        count, why = _probe_import(python, timeout_s)
        if why:
            return no(why, chips)
        return TpuDetection(True, "", versions, chips[0], count)
    return TpuDetection(True, "", versions, chips[0], len(chips))


def require_available(detection: TpuDetection) -> None:
    """The executor's start-up gate: refuse to serve tpu without a usable TPU."""
    if not detection.available:
        raise FailedPrecondition(f"tpu backend unavailable: {detection.reason}")


def eager_mode_for(mode: str, eager_mode_enum: Any) -> Any | None:
    """The `torch.tpu.EagerMode` member for a switchyard mode; None for `compile`."""
    if mode not in TPU_MODES:
        raise InvalidArgument(f"unknown tpu mode {mode!r}; use one of {', '.join(TPU_MODES)}")
    name = TPU_MODES[mode] or COMPILE_EAGER_FALLBACK
    member = getattr(eager_mode_enum, name, None)
    if member is None:
        offered = [m for m in dir(eager_mode_enum) if m.isupper()]
        raise FailedPrecondition(
            f"this torch_tpu has no EagerMode.{name} (offers {offered}); pick another mode"
        )
    return member if TPU_MODES[mode] is not None else None


def synchronizer(torch_mod: Any, notes: list[str]) -> Callable[[], None]:
    """How to wait for the TPU: torch.accelerator.synchronize wherever torch has it.

    Timers stop after a device sync (docs/architecture.md#backends): torch.tpu.synchronize() once,
    but from torch 2.11 torch_tpu makes it internal
    and it raises RuntimeError when user code calls it; torch.accelerator routes to the same
    function as "the framework". Older torch (no torch.accelerator.synchronize) uses torch.tpu.
    """
    acc = getattr(torch_mod, "accelerator", None)
    if acc is not None and hasattr(acc, "synchronize"):
        notes.append("sync: torch.accelerator.synchronize() (torch.tpu.synchronize is internal here)")
        return acc.synchronize  # type: ignore[no-any-return]
    notes.append("sync: torch.tpu.synchronize()")
    return torch_mod.tpu.synchronize  # type: ignore[no-any-return]


def probe_private(tpu_mod: Any, names: tuple[str, ...], notes: list[str]) -> dict[str, int | None]:
    """Reads private counters; a missing or failing one is None ("unknown"), never a crash."""
    values: dict[str, int | None] = {}
    for name in names:
        fn = getattr(tpu_mod, name, None)
        if fn is None:
            values[name] = None
            notes.append(f"private API torch.tpu.{name} not found: recorded unknown")
            continue
        try:
            values[name] = int(fn())
        except Exception as exc:  # a private API may fail in any way; record, never crash
            values[name] = None
            notes.append(f"private API torch.tpu.{name} failed ({type(exc).__name__}): recorded unknown")
    return values
