"""TorchTPU detection and mode mapping against the real torch_tpu, in its own environment.

Runs when $SWITCHYARD_TPU_PYTHON exists (`make setup-tpu`, TPU VMs; not part of `make test`
because torch_tpu needs libtpu). Without a TPU chip the executor must refuse to start and
detection must say why; the mapping is checked against the real `torch.tpu.EagerMode`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.executor.backends.tpu_env import TPU_MODES
from tests.conftest import ROOT

TPU_PYTHON = os.environ.get("SWITCHYARD_TPU_PYTHON", "")

SCRIPT = """
import json
from services.executor.backends import tpu_env
found = tpu_env.detect()
out = {"available": found.available, "reason": found.reason, "versions": dict(found.versions)}
if found.available or found.reason.startswith("no TPU device"):
    import torch, torch_tpu  # safe: libtpu is present (an absent one aborts the import)
    from torch._dynamo.backends.registry import lookup_backend
    out["modes"] = {m: getattr(tpu_env.eager_mode_for(m, torch.tpu.EagerMode), "name", None)
                    for m in tpu_env.TPU_MODES}
    entered = []
    for m in ("strict", "debug", "defer_and_fuse"):
        with torch.tpu.set_eager_mode(tpu_env.eager_mode_for(m, torch.tpu.EagerMode)):
            entered.append(str(torch.tpu.eager_mode).rsplit(".", 1)[-1])
    out["entered"] = entered
    out["compile_backend"] = type(lookup_backend("tpu")).__name__
    notes = []
    out["private"] = tpu_env.probe_private(torch.tpu, tpu_env.PRIVATE_COUNTERS, notes)
    tpu_env.synchronizer(torch, notes)
    out["notes"] = notes
print(json.dumps(out))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [TPU_PYTHON, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, check=False
    )


@pytest.fixture(scope="module")
def tpu_python() -> str:
    if not TPU_PYTHON or not Path(TPU_PYTHON).is_file():
        pytest.skip(f"TorchTPU environment not built (SWITCHYARD_TPU_PYTHON={TPU_PYTHON!r}); TPU VMs only")
    return TPU_PYTHON


def test_real_detection_and_mode_mapping(tpu_python: str) -> None:
    done = _run("-c", SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["versions"]["torch_tpu"] != "not installed"
    if not found["available"]:
        assert found["reason"].startswith(("no TPU device", "libtpu is not installed")), found
    if "modes" in found:
        # every name the tpu backend uses exists in this torch_tpu and behaves as read
        assert found["modes"] == {m: TPU_MODES[m] for m in TPU_MODES}
        assert found["entered"] == ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE"]
        assert found["compile_backend"] == "TpuBackend"
        assert set(found["private"]) == {"_get_cache_requests", "_get_cache_hits", "_get_cache_misses"}
        assert any(n.startswith("sync: torch.accelerator.synchronize()") for n in found["notes"])


def test_real_executor_refuses_without_a_tpu(tpu_python: str) -> None:
    if any(Path("/dev").glob("accel*")) or any(Path("/dev").glob("vfio/*")):
        pytest.skip("a TPU may be attached here: refusal is not expected")
    done = _run("-m", "clients.cli", "executor", "serve", "--backend", "tpu", "--port", "0")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "backend 'tpu' is unavailable:" in done.stderr and "Traceback" not in done.stderr
