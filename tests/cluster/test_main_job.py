"""The main job end to end: `switchyard up` as a subprocess, then what `make run` does.

A team key, inference through the router with `tritonclient.grpc` (a share shadowed to the
XLA path), a `tiny-lm` trial cpu-eager vs xla to its verdict on the real Temporal dev server,
and the finance report; then SIGINT, as Ctrl-C would send, and the checks that matter after
a stop: every process the cluster started is gone, and the ledger's audit chain verifies.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from clients.local_cluster.demo import Endpoints, MainJobResult, run_main_job
from tests.cluster.up_helpers import start_up, xla_cluster_config
from tests.processes import alive, descendants
from tests.xla.conftest import require_xla_env

pytestmark = [pytest.mark.slow, pytest.mark.xla]

STARTUP_S = 300


def _wait_for_state(proc: subprocess.Popen[bytes], state_file: Path, log: Path) -> dict[str, object]:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"switchyard up exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if state_file.exists():
            return dict(json.loads(state_file.read_text()))
        time.sleep(0.5)
    pytest.fail(f"cluster not up after {STARTUP_S}s:\n{log.read_text()[-4000:]}")


def _assert_main_job(result: MainJobResult, ep: Endpoints) -> None:
    """What the main job must have done: served, trialled, and costed every request."""
    # Inference with a key: every request answered, through the router, by the CPU path.
    sent = sum(t.sent for t in result.traffic)
    assert sent == 200
    assert sum(t.ok for t in result.traffic) == sent, [t.errors for t in result.traffic]
    assert {p for t in result.traffic for p in t.answered_by} == {ep.paths["cpu"]}

    # The trial reached its verdict, with a verdict for the candidate path.
    assert result.trial is not None
    assert result.trial.status == "completed"
    assert result.trial.verdicts.get("xla") in ("ADOPT", "REJECT", "INCONCLUSIVE"), result.trial.report
    assert result.trial.reasons["xla"], "a verdict comes with its reasons per criterion"
    assert result.reports["trial"].read_text().lstrip().lower().startswith("<!doctype html")
    # Serving continues after the trial, for every model.
    assert [(t.model, t.ok) for t in result.after_trial] == [("mlp", 16), ("tiny-lm", 16)]

    # The finance report: the requests are completed jobs of cpu-eager, with idle time shown.
    rows = {r.path: r for r in result.finance}
    cpu = rows[ep.paths["cpu"]]
    assert cpu.jobs_completed >= sent
    assert cpu.total_micros > 0
    assert cpu.total_micros == cpu.busy_micros + cpu.idle_micros + cpu.prepare_micros
    assert abs(cpu.cost_per_completed_job_micros - cpu.total_micros / cpu.jobs_completed) <= 0.5
    assert 0.0 < cpu.idle_share < 1.0
    assert ep.paths["xla"] in rows  # the trial's and the shadow's cost of the XLA path
    assert result.reports["finance"].read_text().lstrip().lower().startswith("<!doctype html")


def test_up_main_job_and_clean_stop(tmp_path: Path) -> None:
    config = xla_cluster_config(tmp_path, require_xla_env())
    log = tmp_path / "up.log"
    proc = start_up(config, tmp_path, log)
    started: set[int] = set()
    try:
        state = _wait_for_state(proc, tmp_path / "state" / "cluster.json", log)
        started = descendants(proc.pid)
        services = state["services"]
        assert isinstance(services, dict)
        assert set(services) >= {
            "temporal",
            "metering",
            "evaluator",
            "executor-cpu",
            "executor-xla",
            "router",
            "trial-worker",
        }
        assert {services[name]["pid"] for name in services} <= started

        ep = Endpoints.from_state(state)
        lines: list[str] = []
        result = asyncio.run(
            run_main_job(ep, tmp_path / "reports", requests=200, concurrency=8, tell=lines.append)
        )

        _assert_main_job(result, ep)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"switchyard up did not stop within 90s of SIGINT:\n{log.read_text()[-4000:]}")

    assert code == 0, log.read_text()[-4000:]
    left = sorted(pid for pid in started if alive(pid))
    assert left == [], f"processes left behind: {left}"
    assert not (tmp_path / "state" / "cluster.json").exists()
    # Every usage event reached the ledger: none arrived after its reservation had closed.
    router_log = (tmp_path / "state" / "logs" / "router.log").read_text()
    assert "metering refused" not in router_log and "kept in the spool" not in router_log

    # The ledger, read straight from its file after the stop: the audit chain is intact.
    from services.metering.ledger import Ledger

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'state' / 'ledger.db'}", run_migrations=False)
    try:
        verification = ledger.audit.verify()
    finally:
        ledger.close()
    assert verification.ok, verification
    assert verification.rows_checked > 0
