"""A deployment as the Kubernetes manifests make it: each service its own process, no `switchyard up`.

The migrate Job, then metering, an executor and a router, each started with the arguments of
its manifest (deploy/k8s/base) and ports of its own; nobody registers a path or sets a
price by hand. A team's client, written against tritonclient alone, sends requests with its
key in the `authorization` header. Every answered request must then be one completed job of
that team in the ledger: the router registered its deployment's path itself, from what the
executor describes. With no price in force, that usage is recorded unpriced (and reported
so), not held back; once a price is set, later usage is priced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.local_cluster import health
from clients.local_cluster.traffic import create_team_key
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
from switchyard.net import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
PATH_ID = "cpu-a@local"  # the name the routes give the deployment; metering has never heard of it


@dataclass
class Deployment:
    tmp: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.tmp,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait_serving(self, name: str, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while asyncio.run(health.grpc_health(address)) != health.SERVING:
            assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{name} not SERVING after {timeout_s}s:\n{self.log(name)}"
            time.sleep(0.3)

    def stop(self) -> None:
        for name in ("router", "executor", "metering"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "OTEL_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["SWITCHYARD_SECURITY_INSECURE"] = "true"  # plaintext, named (the manifests mount certificates)
    env["SWITCHYARD_DATABASE_URL"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    d = Deployment(tmp_path, env=env)
    try:
        yield d
    finally:
        d.stop()


def _team_jobs(metering: str, team: str) -> tuple[int, int, int]:
    """(completed, total, unpriced events) of `team` in the ledger's cost report."""

    async def report() -> mpb.CostReportResponse:
        async with grpc.aio.insecure_channel(metering) as channel:
            stub = mgrpc.MeteringStub(channel)
            return await stub.CostReport(mpb.CostReportRequest(group_by=["team"]), timeout=10)

    rows = [r for r in asyncio.run(report()).rows if r.group.get("team") == team]
    return (
        sum(r.jobs_completed for r in rows),
        sum(r.jobs_total for r in rows),
        sum(r.unpriced_events for r in rows),
    )


def _infer(router: str, key: str, count: int, offset: int) -> int:
    """An outside client: tritonclient only, the team's key in the `authorization` header."""
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(url=router)
    headers = {"authorization": f"Bearer {key}"}
    answered = 0
    try:
        deadline = time.monotonic() + 60  # the router re-admits an executor that came up late
        while not client.is_model_ready("mlp", headers=headers):
            assert time.monotonic() < deadline, "the router never reported mlp ready"
            time.sleep(0.3)
        for i in range(count):
            tensor = triton.InferInput("x", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.full((1, 64), i / count, dtype=np.float32))
            reply = client.infer("mlp", [tensor], headers=headers, request_id=f"outside-{offset + i}")
            assert reply.as_numpy("y").shape == (1, 16)
            answered += 1
    finally:
        client.close()
    return answered


def _wait_jobs(metering: str, team: str, want: int, timeout_s: float = 30.0) -> tuple[int, int, int]:
    deadline = time.monotonic() + timeout_s
    seen = _team_jobs(metering, team)
    while seen[0] < want and time.monotonic() < deadline:
        time.sleep(0.3)
        seen = _team_jobs(metering, team)
    return seen


def test_each_service_its_own_process_usage_reaches_the_ledger(deployment: Deployment) -> None:
    metering = f"{HOST}:{free_port(HOST)}"
    executor = f"{HOST}:{free_port(HOST)}"
    router = f"{HOST}:{free_port(HOST)}"
    # the migrate Job, then the Deployments (args as in deploy/k8s/base/*.yaml, ports ours)
    subprocess.run(
        [sys.executable, "-m", "clients.cli", "metering", "migrate"],
        env=deployment.env,
        cwd=deployment.tmp,
        check=True,
        capture_output=True,
        timeout=120,
    )
    deployment.start("metering", "metering", "serve", "--host", HOST, "--port", metering.split(":")[1])
    deployment.start(
        "executor",
        "executor", "serve", "--backend", "cpu", "--host", HOST, "--port", executor.split(":")[1],
        "--frames-port", "0", "--models", "mlp", "--threads", "1",
    )  # fmt: skip
    routes = deployment.tmp / "routes.toml"
    routes.write_text(
        f'[router]\nspool_dir = "{deployment.tmp / "spool"}"\n\n'
        f'[deployments.cpu-a]\naddress = "{executor}"\npath = "{PATH_ID}"\n\n'
        '[routes.mlp]\npolicy = "pinned"\ntargets = ["cpu-a"]\n'
    )
    deployment.wait_serving("metering", metering, 60)
    # the router starts before the executor is ready, as pods do: it registers the path later
    deployment.start(
        "router",
        "router", "serve", "--host", HOST, "--port", router.split(":")[1], "--config", str(routes),
        "--metering", metering, "--spool-dir", str(deployment.tmp / "spool"),
    )  # fmt: skip
    deployment.wait_serving("executor", executor, 180)
    deployment.wait_serving("router", router, 60)

    team = asyncio.run(create_team_key(metering, "team-outside"))
    answered = _infer(router, team.key, 40, 0)
    assert answered == 40
    completed, total, unpriced = _wait_jobs(metering, team.team, answered)
    assert (completed, total) == (answered, answered), deployment.log("router")
    assert unpriced == answered  # no price in force: recorded, and reported as unpriced

    # The path was registered by the router with what the executor describes.
    async def paths() -> list[mpb.PathInfo]:
        async with grpc.aio.insecure_channel(metering) as channel:
            return list(
                (await mgrpc.MeteringStub(channel).ListPaths(mpb.ListPathsRequest(), timeout=10)).paths
            )

    (registered,) = asyncio.run(paths())
    assert (registered.path, registered.backend, registered.priced) == (PATH_ID, "cpu", False)
    listed = subprocess.run(
        [sys.executable, "-m", "clients.cli", "paths", "list", "--metering", metering],
        env=deployment.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert PATH_ID in listed.stdout and "unpriced" in listed.stdout
    assert not list((deployment.tmp / "spool").glob("*.pb")), "usage still waits in the spool"

    # An operator sets the price the executor named; usage from then on is priced.
    subprocess.run(
        [sys.executable, "-m", "clients.cli", "prices", "set", registered.price_key, "0.12",
         "--metering", metering],
        env=deployment.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    time.sleep(0.01)
    more = _infer(router, team.key, 10, 40)
    completed, total, unpriced = _wait_jobs(metering, team.team, answered + more)
    assert (completed, total, unpriced) == (answered + more, answered + more, answered)
