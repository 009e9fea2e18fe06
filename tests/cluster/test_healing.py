"""`switchyard up` heals: a SIGKILLed executor is restarted while the router fails over, and a
SIGKILLed supervisor takes every service with it.

One real cluster (Temporal dev server, metering, evaluator, a CPU executor, router, trial
worker) started by `switchyard up` in its own process. The router's routes send `mlp` to the
supervised executor and fail over to a spare executor the test runs itself. A client with a
team key keeps requests in flight while the supervised executor is SIGKILLed: every request
is answered, the executor (restarted from the standby process that had its imports done)
serves again within 10 s, and `switchyard up status` shows the restart and why. Then
`switchyard up` itself is SIGKILLed: within 5 s no process it started is left (the new
standby included).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clients.local_cluster import health
from clients.local_cluster.traffic import create_team_key
from switchyard.net import free_port
from tests.cluster.up_helpers import start_up
from tests.conftest import ROOT
from tests.processes import alive, descendants

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["SWITCHYARD_SECURITY_INSECURE"] = "true"  # plaintext, named: the test's client is plaintext
    return env


def _wait(predicate: object, timeout_s: float, what: str, log: Path | None = None) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s\n{tail}"
        time.sleep(0.1)


def _ready_after(log: Path, service: str) -> tuple[float, ...]:
    """Seconds each start of `service` took, from the supervisor's "ready after" lines."""
    found = tuple(
        float(words[3].rstrip("s"))
        for words in (line.split() for line in log.read_text(errors="replace").splitlines())
        if words[:3] == [service, "ready", "after"]
    )
    assert found, f"no 'ready after' line for {service} in {log}"
    return found


async def _load(
    router: str, key: str, stop: asyncio.Event, answered: dict[str, int], errors: list[str]
) -> None:
    import tritonclient.grpc.aio as triton
    from tritonclient.utils import InferenceServerException

    client = triton.InferenceServerClient(url=router)
    headers = {"authorization": f"Bearer {key}"}

    async def one_client(n: int) -> None:
        i = 0
        while not stop.is_set():
            tensor = triton.InferInput("x", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.full((1, 64), n + i / 1000, dtype=np.float32))
            try:
                reply = await client.infer("mlp", [tensor], headers=headers, client_timeout=20)
            except InferenceServerException as exc:
                errors.append(f"{exc.status()}: {exc.message()}")
            else:
                path = reply.get_response().parameters["path"].string_param
                answered[path] = answered.get(path, 0) + 1
            i += 1

    try:
        await asyncio.gather(*(one_client(n) for n in range(4)))
    finally:
        await client.close()


def _write_config(tmp_path: Path, state: Path, supervised: int, spare: int) -> Path:
    """A cluster whose CPU executor (on `supervised`) fails over to an unsupervised spare."""
    routes = tmp_path / "routes.toml"
    routes.write_text(
        f'[router]\nspool_dir = "{state / "spool"}"\n\n'
        f'[deployments.cpu]\naddress = "{HOST}:{supervised}"\npath = "cpu-supervised"\n\n'
        f'[deployments.spare]\naddress = "{HOST}:{spare}"\npath = "cpu-spare"\n\n'
        '[routes.mlp]\npolicy = "failover"\ntargets = ["cpu", "spare"]\n'
    )
    config = tmp_path / "switchyard.toml"
    config.write_text(
        f'state_dir = "{state}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        f'[router]\nport = 0\nopenai_port = 0\nroutes_file = "{routes}"\n'
        f'[executors.cpu]\nport = {supervised}\nmodels = ["mlp"]\n[executors.xla]\nenabled = false\n'
    )
    return config


def _standby(state_file: Path) -> str:
    """The supervised executor's standby (imports done once "ready"), from cluster.json."""
    return str(json.loads(state_file.read_text())["services"]["executor-cpu"].get("standby"))


async def _kill_and_recover(
    router: str,
    key: str,
    executor_pid: int,
    supervised: int,
    answered: dict[str, int],
    errors: list[str],
    state_file: Path,
) -> float:
    """Under load, SIGKILL the supervised executor once its standby is ready (the cluster is up
    once it is); seconds until it is SERVING again (and the router sends it requests again)."""
    stop = asyncio.Event()
    load = asyncio.ensure_future(_load(router, key, stop, answered, errors))
    ready_by = time.monotonic() + 180
    try:
        while answered.get("cpu-supervised", 0) < 20 or _standby(state_file) != "ready":
            assert not load.done(), load
            assert time.monotonic() < ready_by, f"no ready standby: {_standby(state_file)!r}"
            await asyncio.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(executor_pid, signal.SIGKILL)
        # back: SERVING again on its port, which the executor reports once mlp is warm
        while True:
            back = await health.grpc_health(f"{HOST}:{supervised}", timeout_s=0.5)
            if back == health.SERVING:
                break
            assert time.monotonic() - killed_at < 30, "the executor did not come back"
            await asyncio.sleep(0.1)
        back_after = time.monotonic() - killed_at
        served_before = answered.get("cpu-supervised", 0)
        # the router re-admits it and routes to it again
        until = time.monotonic() + 20
        while answered.get("cpu-supervised", 0) <= served_before + 5 and time.monotonic() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        return back_after
    finally:
        stop.set()
        await load


def _assert_status_shows_the_restart(
    config: Path, env: dict[str, str], up_log: Path, state_file: Path, executor_pid: int
) -> None:
    """`switchyard up status` and cluster.json show one restart and why."""
    status = subprocess.run(
        [sys.executable, "-m", "clients.cli", "up", "status", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    row = next(line for line in status.stdout.splitlines() if line.startswith("executor-cpu"))
    assert "SERVING" in row and " 1 " in row and "killed by SIGKILL" in row, status.stdout
    assert "restarting in" in up_log.read_text()
    assert "executor-cpu restarted from its standby" in up_log.read_text()
    restarted = json.loads(state_file.read_text())["services"]["executor-cpu"]
    assert restarted["pid"] != executor_pid and restarted["restarts"] == 1
    assert restarted["standby"] in ("starting", "ready")  # a new one, for the next crash


def test_executor_killed_under_load_is_restarted_and_a_killed_supervisor_leaves_nothing(
    tmp_path: Path,
) -> None:
    supervised, spare = free_port(HOST), free_port(HOST)
    state = tmp_path / "state"
    config = _write_config(tmp_path, state, supervised, spare)
    env = _env()
    spare_log = (tmp_path / "spare.log").open("wb")
    spare_proc = subprocess.Popen(
        [sys.executable, "-m", "clients.cli", "executor", "serve", "--port", str(spare), "--models", "mlp",
         "--threads", "1"],
        stdout=spare_log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    up_log = tmp_path / "up.log"
    up = start_up(config, tmp_path, up_log, env)
    started: set[int] = set()
    try:
        state_file = state / "cluster.json"
        _wait(lambda: state_file.exists() or up.poll() is not None, 240, "cluster.json", up_log)
        assert up.poll() is None, up_log.read_text()[-3000:]
        services = json.loads(state_file.read_text())["services"]
        router, metering = services["router"]["address"], services["metering"]["address"]
        executor_pid = services["executor-cpu"]["pid"]
        _wait(lambda: asyncio.run(health.grpc_health(f"{HOST}:{spare}")) == health.SERVING, 120, "spare")
        team = asyncio.run(create_team_key(metering, "team-heal"))

        answered: dict[str, int] = {}
        errors: list[str] = []

        back_after = asyncio.run(
            _kill_and_recover(router, team.key, executor_pid, supervised, answered, errors, state_file)
        )
        assert errors == [], errors[:5]
        # Back within 10 s: detection, back-off, the standby's start as the executor (model
        # load, warm-up) and the health probe together.
        # the supervisor logs the restart's "ready after" at its own next probe, which may come
        # a moment after this test's probe saw the executor SERVING
        restarted = "the restart's 'ready after' line"
        _wait(lambda: len(_ready_after(up_log, "executor-cpu")) >= 2, 10, restarted, up_log)
        cold_start, restart_start = _ready_after(up_log, "executor-cpu")
        assert back_after < 10.0, (
            f"executor back after {back_after:.1f}s (the restarted process's own start: "
            f"{restart_start:.1f}s, its first start {cold_start:.1f}s)"
        )
        print(
            f"executor back after {back_after:.1f}s; the restarted process took {restart_start:.1f}s "
            f"to start (its first start {cold_start:.1f}s)"
        )
        assert answered.get("cpu-spare", 0) > 0, answered  # the router failed over meanwhile
        assert answered.get("cpu-supervised", 0) > 25, answered  # and came back to it

        _assert_status_shows_the_restart(config, env, up_log, state_file, executor_pid)

        # The supervisor SIGKILLed: the kernel takes its children (PR_SET_PDEATHSIG) and theirs.
        started = descendants(up.pid)
        assert {s["pid"] for s in json.loads(state_file.read_text())["services"].values()} <= started
        up.kill()
        up.wait(10)
        _wait(lambda: not [p for p in started if alive(p)], 5.0, "every service gone after SIGKILL")
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(90)
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        os.killpg(spare_proc.pid, signal.SIGTERM)
        spare_proc.wait(30)
        spare_log.close()
