"""`make run` with mutual TLS on, as a user gets it: `python -m clients.cli demo` in a process
whose environment does not say SWITCHYARD_SECURITY_INSECURE (tests/conftest.py sets it for
every other test, which once hid an mTLS break in `make run`).

The demo brings the cluster up with the certificates `switchyard up` issues, sends inference
through the router, runs the tiny-lm trial cpu-eager vs xla on Temporal (its start authorised
by the team key's `trials:run`: workflows/activities/authorization.py) and prints the finance report; it
must exit 0, with every service on mTLS and the trial at its verdict.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from clients.local_cluster import plan
from switchyard import tls
from tests.cluster.up_helpers import xla_cluster_config
from tests.conftest import ROOT
from tests.xla.conftest import require_xla_env

pytestmark = [pytest.mark.slow, pytest.mark.xla]

SERVICES = ("metering", "evaluator", "executor-cpu", "executor-xla", "router", "trial-worker")


def test_make_run_passes_with_mtls_on(tmp_path: Path) -> None:
    config = xla_cluster_config(tmp_path, require_xla_env())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_SECURITY_")}
    env["PYTHONPATH"] = str(ROOT)
    assert tls.INSECURE_ENV not in env
    argv = [sys.executable, "-m", "clients.cli", "demo", "--config", str(config)]
    argv += ["--requests", "60", "--concurrency", "4"]
    done = subprocess.run(
        argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1500, check=False
    )
    logs = tmp_path / "state" / "logs"
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, tail
    assert re.search(r"trial demo-tiny-lm-\S+: completed", done.stdout), tail
    assert re.search(r"^\s+xla: (ADOPT|REJECT|INCONCLUSIVE)", done.stdout, re.M), tail
    for name in SERVICES:  # each says how it talks in its first lines: mTLS as its identity
        text = (logs / f"{name}.log").read_text()
        identity = name.split("-")[0].replace("trial", "worker")
        assert f"mTLS as spiffe://switchyard/{identity}" in text, (name, text[:2000])
        assert "INSECURE" not in text, name
    assert (tmp_path / "state" / "tls" / "ca").is_dir()
    ui_key = plan.ui_key_file(tmp_path / "state")  # the Temporal UI principal's, for the worker
    assert stat.S_IMODE(ui_key.stat().st_mode) == 0o600 and ui_key.read_text().strip(), ui_key
