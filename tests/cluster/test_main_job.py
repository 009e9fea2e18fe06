"""The main job end to end, as `make run` starts it: `python -m clients.cli demo --keep` as a
subprocess with mutual TLS on (its environment does not say SWITCHYARD_SECURITY_INSECURE,
which tests/conftest.py sets for every other test and which once hid an mTLS break in
`make run`), then SIGINT, as Ctrl-C would send.

One run serves both tests (it is the suite's most expensive set-up): the main job's results
(a team key, inference through the router with `tritonclient.grpc`, a share shadowed to the XLA
path, a `tiny-lm` trial cpu-eager vs xla to its verdict on the real Temporal dev server, the
finance report), read from the `reports/main-job.json` the demo writes; and what matters after
a stop: every process the cluster started is gone, and the ledger's audit chain verifies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients.local_cluster import plan
from clients.local_cluster.demo import Endpoints
from switchyard import tls
from tests.cluster.up_helpers import xla_cluster_config
from tests.conftest import ROOT
from tests.processes import alive, descendants
from tests.xla.conftest import require_xla_env

pytestmark = [pytest.mark.slow, pytest.mark.xla]

JOB_S = 1500  # start-up and the main job, on a loaded 2-core host
REQUESTS = 200
SERVICES = ("metering", "evaluator", "executor-cpu", "executor-xla", "router", "trial-worker")


@dataclass(frozen=True)
class DemoRun:
    root: Path  # the demo's working directory; its state under root / "state"
    output: str  # what the demo printed
    result: dict[str, Any]  # reports/main-job.json
    state: dict[str, Any]  # cluster.json while the cluster ran
    started: set[int]  # every process below the demo while it served
    code: int  # its exit status after SIGINT


def _wait_for_result(proc: subprocess.Popen[bytes], result: Path, log: Path) -> None:
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"switchyard demo exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        if result.exists() and "cluster is up" in log.read_text():
            return
        time.sleep(0.5)
    pytest.fail(f"the main job did not finish within {JOB_S}s:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    root = tmp_path_factory.mktemp("demo")
    config = xla_cluster_config(root, require_xla_env())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_SECURITY_")}
    env["PYTHONPATH"] = str(ROOT)
    assert tls.INSECURE_ENV not in env
    argv = [sys.executable, "-m", "clients.cli", "demo", "--config", str(config), "--keep"]
    argv += ["--requests", str(REQUESTS), "--concurrency", "8"]
    log = root / "demo.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    started: set[int] = set()
    state: dict[str, Any] = {}
    result_file = root / "state" / "reports" / "main-job.json"
    try:
        _wait_for_result(proc, result_file, log)
        started = descendants(proc.pid)
        state = json.loads((root / "state" / "cluster.json").read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"switchyard demo did not stop within 90s of SIGINT:\n{log.read_text()[-4000:]}")
    result = json.loads(result_file.read_text())
    return DemoRun(root, log.read_text(), result, state, started, code)


def _assert_main_job(result: dict[str, Any], paths: dict[str, str]) -> None:
    """What the main job must have done: served, trialled, and costed every request."""
    traffic = result["traffic"]
    # Inference with a key: every request answered, through the router, by the CPU path.
    sent = sum(t["sent"] for t in traffic)
    assert sent == REQUESTS
    assert sum(t["ok"] for t in traffic) == sent, [t["errors"] for t in traffic]
    assert {p for t in traffic for p in t["answered_by"]} == {paths["cpu"]}

    # The trial reached its verdict, with a verdict for the candidate path.
    trial = result["trial"]
    assert trial is not None and trial["status"] == "completed"
    assert trial["verdicts"].get("xla") in ("ADOPT", "REJECT", "INCONCLUSIVE"), trial["report"]
    assert trial["reasons"]["xla"], "a verdict comes with its reasons per criterion"
    assert Path(result["reports"]["trial"]).read_text().lstrip().lower().startswith("<!doctype html")
    # Serving continues after the trial, for every model.
    assert [(t["model"], t["ok"]) for t in result["after_trial"]] == [("mlp", 16), ("tiny-lm", 16)]

    # The finance report: the requests are completed jobs of cpu-eager, with idle time shown.
    rows = {r["path"]: r for r in result["finance"]}
    cpu = rows[paths["cpu"]]
    assert cpu["jobs_completed"] >= sent
    assert cpu["total_micros"] > 0
    assert cpu["total_micros"] == cpu["busy_micros"] + cpu["idle_micros"] + cpu["prepare_micros"]
    assert abs(cpu["cost_per_completed_job_micros"] - cpu["total_micros"] / cpu["jobs_completed"]) <= 0.5
    # Each line is rounded once to the micro-unit (costmodel.py). At the example price (120,000
    # micros an hour, 0.033 a millisecond) a request busy under 15 ms is charged 0, and on a
    # quiet machine every request is: busy may be 0, with the reserved rest shown as idle.
    assert 0 < cpu["idle_micros"] <= cpu["total_micros"]
    assert paths["xla"] in rows  # the trial's and the shadow's cost of the XLA path
    assert Path(result["reports"]["finance"]).read_text().lstrip().lower().startswith("<!doctype html")
    # the result file names the team, never its key
    assert set(result["team"]) == {"team", "key_id"}


def test_up_main_job_and_clean_stop(demo_run: DemoRun) -> None:
    services = demo_run.state["services"]
    assert set(services) >= {"temporal", *SERVICES}
    assert {services[name]["pid"] for name in services} <= demo_run.started
    _assert_main_job(demo_run.result, dict(Endpoints.from_state(demo_run.state).paths))

    assert demo_run.code == 0, demo_run.output[-4000:]
    left = sorted(pid for pid in demo_run.started if alive(pid))
    assert left == [], f"processes left behind: {left}"
    state_dir = demo_run.root / "state"
    assert not (state_dir / "cluster.json").exists()
    # Every usage event reached the ledger: none arrived after its reservation had closed.
    router_log = (state_dir / "logs" / "router.log").read_text()
    assert "metering refused" not in router_log and "kept in the spool" not in router_log

    # The ledger, read straight from its file after the stop: the audit chain is intact.
    from services.metering.ledger import Ledger

    ledger = Ledger.open(f"sqlite:///{state_dir / 'ledger.db'}", run_migrations=False)
    try:
        verification = ledger.audit.verify()
    finally:
        ledger.close()
    assert verification.ok, verification
    assert verification.rows_checked > 0


def test_make_run_passes_with_mtls_on(demo_run: DemoRun) -> None:
    """The demo's own summary, and every service on mTLS as its identity."""
    out = demo_run.output
    assert re.search(r"trial demo-tiny-lm-\S+: completed", out), out[-3000:]
    assert re.search(r"^\s+xla: (ADOPT|REJECT|INCONCLUSIVE)", out, re.M), out[-3000:]
    assert "main-job.json" in out  # the summary names the result file with the reports
    logs = demo_run.root / "state" / "logs"
    for name in SERVICES:  # each says how it talks in its first lines: mTLS as its identity
        text = (logs / f"{name}.log").read_text()
        identity = name.split("-")[0].replace("trial", "worker")
        assert f"mTLS as spiffe://switchyard/{identity}" in text, (name, text[:2000])
        assert "INSECURE" not in text, name
    assert (demo_run.root / "state" / "tls" / "ca").is_dir()
    ui_key = plan.ui_key_file(demo_run.root / "state")  # the Temporal UI principal's, for the worker
    assert stat.S_IMODE(ui_key.stat().st_mode) == 0o600 and ui_key.read_text().strip(), ui_key
