"""A switchyard cluster laid across network namespaces: one host per service, mTLS between them.

Hosts (tests/faults/netns.py, each its own address on one bridge): `pg` (a PostgreSQL server
of the harness's own, tests/faults/postgres.py, which a fault can restart: the ledger is
reached across a link), `metering`, `exec-a` and `exec-b` (CPU executors serving mlp),
`router`, and `client` (the load). With `replicas`, a second metering (`metering-b`, on the
same ledger) and a second router (`router-b`, its own spool, metering-b first and metering
second in its channel's address list) too. The router reaches exec-b through a relay on its
own host (`link`: delay and loss, see link_proxy.py; this kernel has no netem). Each service
holds its own certificate from one CA (`switchyard.tls.ensure_local_pki`; replicas share
their service's), and every hop checks that the server it dials holds the identity it
expects (its name, not its address). The metering replicas share one audit key.
Processes log with wall-clock stamps to `<dir>/<host>.log`, so a test times what the
services did against when it injected a fault.

Every wait is bounded; `close` kills what it started, stops PostgreSQL and removes the
namespaces, and the fixture calls it even when a test fails.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa

from services.metering.schema import JOBS
from switchyard import tls
from tests.faults.netns import Host, Network
from tests.faults.postgres import PgServer

ROOT = Path(__file__).resolve().parents[2]
PORT = 7001  # every service's gRPC port on its own host (each host has its own address)
FRAMES_PORT = 7002  # the executors' frame port (the router learns it from Describe)
RELAY = "127.0.0.2"  # on the router host: the relay that is its link to exec-b (`link`)
TEAM = "faults"
AUDIT_KEY_ENV = "SWITCHYARD_AUDIT_KEY"  # services/metering/auditkey.py
START_S = 120  # a service's start, at most (torch's import on a loaded 2-core host)

_LOGGING = (
    "import logging, sys; logging.basicConfig(stream=sys.stderr, level=logging.INFO, "
    "format='%(created).3f %(levelname)s %(name)s %(message)s')\n"
)
METERING = (
    _LOGGING
    + """
import asyncio, sys
import grpc
from services.metering.metering_server import start_metering
from switchyard import tls
from switchyard.grpcio import ServerOptions
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb, metering_pb2_grpc as mgrpc
from tests.router.conftest import prepare_ledger

async def main() -> None:
    url, host, port, operator, team, prepare = sys.argv[1:7]
    running = await start_metering(url, ServerOptions(host=host, port=int(port)))
    if prepare != "prepare":  # a replica: the first one made the prices, paths and the key
        print("READY -", flush=True)
        await running.serve_until_signal()
        return
    security = tls.Security.from_dir(operator)
    async with tls.aio_channel(f"{host}:{port}", (), security, expect=tls.METERING) as channel:
        stub = mgrpc.MeteringStub(channel)
        await prepare_ledger(stub)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="svc-faults", kind="service", team=team))
        await stub.GrantRole(mpb.RoleRequest(principal="svc-faults", role="infer", scope="*"))
        key = (await stub.CreateKey(mpb.CreateKeyRequest(principal="svc-faults"))).key
    print("READY", key, flush=True)
    await running.serve_until_signal()

asyncio.run(main())
"""
)
EXECUTOR = (
    _LOGGING
    + """
import asyncio, sys
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_server import start_executor

async def main() -> None:
    config = ExecutorConfig(host=sys.argv[1], port=int(sys.argv[2]), frames_port=int(sys.argv[3]),
                            models=("mlp",), max_queue_size=256)
    running = await start_executor(config)
    print("READY", flush=True)
    await running.serve_until_signal()

asyncio.run(main())
"""
)
ROUTER = (
    _LOGGING
    + """
import asyncio, json, sys
from pathlib import Path
from services.router import router_config
from services.router.router_server import start_router
from switchyard.grpcio import ServerOptions

async def main() -> None:
    cfg = router_config.parse(json.loads(sys.argv[1]))
    options = ServerOptions(host=sys.argv[3], port=int(sys.argv[4]))
    running = await start_router(cfg, sys.argv[2], options, Path(sys.argv[5]))
    print("READY", flush=True)
    await running.serve_until_signal()

asyncio.run(main())
"""
)
# The client host's load, through Triton's own client (tritonclient.grpc.aio, as a team's code
# calls a Triton server): `clients` concurrent callers for `seconds` (or until SIGUSR1), at most
# `limit` requests; every answer's request id and every error (its gRPC status), with wall-clock
# times, as JSON.
CLIENT = """
import asyncio, json, signal, sys, time
import numpy as np
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

X = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
RETRY_ELSEWHERE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")

def _inputs() -> list:
    x = triton.InferInput("x", list(X.shape), "FP32")
    x.set_data_from_numpy(X)
    return [x]

def _code(exc: InferenceServerException) -> str:
    return str(exc.status() or "UNKNOWN").removeprefix("StatusCode.")

async def _infer(client, headers) -> str:
    result = await client.infer("mlp", _inputs(), headers=headers, client_timeout=10)
    return result.get_response().parameters["request_id"].string_param

async def main() -> None:
    address, key, clients, seconds, limit, out = sys.argv[1:7]
    routers = address.split(",")  # caller i starts on router i mod n, and moves on when one fails
    answers, errors, sent = [], [], iter(range(int(limit)))
    headers = {"authorization": f"Bearer {key}"}
    first = triton.InferenceServerClient(routers[0])  # the first answer (counted): GO
    try:
        for _ in range(300):
            t0 = time.time()
            try:
                rid = await _infer(first, headers)
            except InferenceServerException as exc:
                errors.append([t0, time.time(), _code(exc)])
                await asyncio.sleep(0.1)
            else:
                answers.append([t0, time.time(), rid])
                break
    finally:
        await first.close()
    print("GO", flush=True)
    end = time.time() + float(seconds)

    def end_now() -> None:  # SIGUSR1 (Cluster.end_load): no new call from now on
        nonlocal end
        end = time.time()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, end_now)

    async def one(i: int) -> None:
        stubs = [triton.InferenceServerClient(a) for a in routers]
        try:
            for _ in sent:
                if time.time() >= end:
                    return
                t0 = time.time()
                try:
                    rid = await _infer(stubs[i % len(stubs)], headers)
                except InferenceServerException as exc:
                    errors.append([t0, time.time(), _code(exc)])
                    i += _code(exc) in RETRY_ELSEWHERE
                    await asyncio.sleep(0.02)
                else:
                    answers.append([t0, time.time(), rid])
        finally:
            for c in stubs:
                await c.close()

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(int(clients)))), float(seconds) + 30)
    Path = __import__("pathlib").Path
    Path(out).write_text(json.dumps({"answers": answers, "errors": errors}))

asyncio.run(main())
"""


@dataclass
class Load:
    answers: list[tuple[float, float, str]]  # (sent, answered, request id), wall clock
    errors: list[tuple[float, float, str]]  # (sent, failed, status)

    def p99_ms(self, start: float, stop: float) -> float:
        took = sorted((b - a) * 1000 for a, b, _ in self.answers if start <= a < stop)
        return took[min(len(took) - 1, int(0.99 * len(took)))] if took else 0.0

    def settled_at(self, after: float, limit_ms: float, window_s: float = 1.0) -> float | None:
        """The send time of the first answer after `after` from which every answer to a request
        sent in the next `window_s` took at most `limit_ms` (None: the latency never settled)."""
        sent = sorted((a, (b - a) * 1000) for a, b, _ in self.answers if a >= after)
        starts = [a for a, _ in sent]
        for i, start in enumerate(starts):
            end = bisect.bisect_left(starts, start + window_s)
            if end == len(sent):  # no request a whole window later: none can settle
                return None
            if max(ms for _, ms in sent[i:end]) <= limit_ms:
                return start
        return None


@dataclass
class Cluster:
    network: Network
    directory: Path
    router_settings: dict[str, Any] = field(default_factory=dict)
    replicas: bool = False  # metering-b and router-b too (module docstring)
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)
    key: str = ""
    audit_key: str = field(default_factory=lambda: secrets.token_hex(32))  # the replicas' one
    spool_dir: Path | None = None  # the router's spool elsewhere (a small disk of its own)

    def start(self) -> Cluster:
        extra = ("metering-b", "router-b") if self.replicas else ()
        for role in ("pg", "metering", "exec-a", "exec-b", "router", "client", *extra):
            self.hosts[role] = self.network.add(role)
        pki = self.directory / "tls"
        for role in ("exec-a", "exec-b"):  # started first: each imports torch for seconds
            cert = self._cert(pki, role)
            self._launch(role, cert, EXECUTOR, self.hosts[role].address, str(PORT), str(FRAMES_PORT))
        self.pg = PgServer(self.hosts["pg"])
        self.pg.start()
        self.pg.create_database()
        self.ledger_url = self.pg.url
        self._cert(pki, "metering")
        self._cert(pki, "router")
        self.start_metering("metering", prepare=True)
        if self.replicas:  # after the first: it migrated the schema
            self.start_metering("metering-b")
        self._ready("exec-a")
        self._ready("exec-b")
        self._start_link()
        self.start_router()
        if self.replicas:
            self.start_router("router-b")
        return self

    def start_metering(self, role: str, prepare: bool = False) -> None:
        """`role`'s metering on the ledger (and, with `prepare`, the prices, paths and the
        load's key, which the operator's certificate makes there)."""
        pki = self.directory / "tls"
        operator = tls.ensure_local_pki(pki, ["operator"])["operator"]
        self._launch(role, pki / "metering", METERING, self.ledger_url, self.hosts[role].address, str(PORT),
                     str(operator), TEAM, "prepare" if prepare else "replica")  # fmt: skip
        key = self._ready(role).split()[1]
        self.key = key if prepare else self.key

    def _cert(self, pki: Path, role: str) -> Path:
        name = {"exec-a": "executor-a", "exec-b": "executor-b"}.get(role, role)
        return tls.ensure_local_pki(pki, [name])[name]

    def address(self, role: str) -> str:
        return f"{self.hosts[role].address}:{PORT}"

    def _start_link(self) -> None:
        """The router's link to exec-b: a relay process on the router host (link_proxy.py), on
        the gRPC and frame ports, that `link` makes slow or lossy (this kernel has no netem)."""
        self.link_control = self.directory / "link-b.json"
        self.link_control.write_text("{}")
        ports = f"{PORT},{FRAMES_PORT}"
        args = (RELAY, self.hosts["exec-b"].address, ports, str(self.link_control))
        self._launch("link-b", Path(), "", *args, host="router", module="tests.faults.link_proxy")
        self._ready("link-b")

    def link(self, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Sets the router<->exec-b link's delay and loss (the relay reads it within 0.1 s)."""
        self.link_control.write_text(json.dumps({"delay_ms": delay_ms, "loss": loss}))

    def start_router(self, role: str = "router") -> None:
        """`router` dials metering; `router-b` metering-b, then metering (gRPC's pick_first:
        the next address once the first fails). Each its own spool directory."""
        addresses = {"a": self.address("exec-a"), "b": f"{RELAY}:{PORT}"}  # b: through the link
        cfg = {
            "router": {"fleet": "faults", "usage_flush_s": 0.2, **self.router_settings},
            "deployments": {
                name: {"address": addresses[name], "path": path, "price_micros_per_hour": 100}
                for name, path in (("a", "cpu-a"), ("b", "cpu-b"))
            },
            "routes": {"mlp": {"policy": "least_loaded", "targets": ["a", "b"]}},
        }
        meterings = ["metering"] if role == "router" else ["metering-b", "metering"]
        metering = "ipv4:" + ",".join(self.address(m) for m in meterings)
        cert = self.directory / "tls" / "router"
        self._launch(role, cert, ROUTER, json.dumps(cfg), metering, self.hosts[role].address,
                     str(PORT), str(self.spool_of(role)))  # fmt: skip
        self._ready(role)

    def _launch(
        self, role: str, cert: Path, script: str, *args: str, host: str = "", module: str = ""
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), tls.TLS_DIR_ENV: str(cert)}
        env[AUDIT_KEY_ENV] = self.audit_key
        env.pop(tls.INSECURE_ENV, None)
        log = self.logs.setdefault(role, (self.directory / f"{role}.log").open("ab"))
        code = ("-m", module) if module else ("-c", script)
        self.procs[role] = subprocess.Popen(
            self.hosts[host or role].command(sys.executable, *code, *args),
            stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT,
        )  # fmt: skip

    def _ready(self, role: str) -> str:
        """Its READY line, within START_S."""
        stdout = self.procs[role].stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], START_S)
        line = stdout.readline().decode() if ready else ""
        if not line.startswith("READY"):
            raise RuntimeError(f"{role} did not start: {self.log_text(role)[-3000:]}")
        return line

    def load(
        self, clients: int, seconds: float, limit: int = 100_000, routers: tuple[str, ...] = ("router",)
    ) -> subprocess.Popen[bytes]:
        """Starts the client host's load on `routers` (spread, failing over) and returns once it
        has had an answer (its `seconds` run from then); `result` reads it once it ends."""
        out = self.directory / f"load-{time.time():.0f}.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        to = ",".join(self.address(r) for r in routers)
        args = (to, self.key, str(clients), str(seconds), str(limit), str(out))
        command = self.hosts["client"].command(sys.executable, "-c", CLIENT, *args)
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE)
        proc.out = out  # type: ignore[attr-defined]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_S)
        assert ready and proc.stdout.readline().startswith(b"GO"), "the load never got an answer"
        return proc

    @staticmethod
    def end_load(proc: subprocess.Popen[bytes]) -> None:
        """Ends the load before its `seconds`: each caller finishes the call it is in and
        starts no other (nothing, once the load has ended)."""
        proc.send_signal(signal.SIGUSR1)

    @staticmethod
    def result(proc: subprocess.Popen[bytes], timeout_s: float) -> Load:
        assert proc.wait(timeout_s) == 0, "the load client failed"
        raw = json.loads(Path(proc.out).read_text())  # type: ignore[attr-defined]
        return Load([tuple(a) for a in raw["answers"]], [tuple(e) for e in raw["errors"]])

    @property
    def spool(self) -> Path:
        return self.spool_of("router")

    def spool_of(self, role: str) -> Path:
        if role == "router" and self.spool_dir is not None:
            return self.spool_dir
        return self.directory / ("spool" if role == "router" else f"spool-{role}")

    def spool_counts(self) -> tuple[int, int]:
        """(usage/audit segments waiting on disk, dead-lettered events), every router's."""
        segments = dead = 0
        for role in ("router", "router-b") if self.replicas else ("router",):
            segments += len(list(self.spool_of(role).glob("*.pb")))
            letters = self.spool_of(role) / "dead-letter.jsonl"
            dead += len(letters.read_text().splitlines()) if letters.exists() else 0
        return segments, dead

    def log_text(self, role: str) -> str:
        self.logs[role].flush()
        return (self.directory / f"{role}.log").read_text(errors="replace")

    def logged_at(self, role: str, pattern: str, after: float) -> float | None:
        """The wall-clock time of the first line of `role`'s log matching `pattern` after `after`."""
        for line in self.log_text(role).splitlines():
            stamp, _, text = line.partition(" ")
            try:
                at = float(stamp)
            except ValueError:
                continue
            if at >= after and re.search(pattern, text):
                return at
        return None

    def completed_jobs(self, answered: set[str], timeout_s: float = 20) -> dict[str, int]:
        """The ledger's completed primary jobs per request id, once every answered one is in (bounded)."""
        engine = sa.create_engine(self.pg.local_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                with engine.connect() as conn:
                    rows = conn.execute(
                        sa.select(JOBS.c.job_id, sa.func.count())
                        .where(JOBS.c.team == TEAM, JOBS.c.arm == "primary", JOBS.c.status == "completed")
                        .group_by(JOBS.c.job_id)
                    ).all()
                jobs = {str(k): int(n) for k, n in rows}
                if answered <= set(jobs) or time.monotonic() > deadline:
                    return jobs
                time.sleep(0.2)
        finally:
            engine.dispose()

    def stop(self, role: str) -> None:
        proc = self.procs.pop(role, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def kill(self, role: str) -> None:
        """SIGKILL: no drain, no flush (a lost host, the OOM killer)."""
        proc = self.procs.pop(role)
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        try:
            for proc in self.procs.values():  # all asked at once: each drains in parallel
                if proc.poll() is None:
                    proc.terminate()
            for role in ("router", "router-b", "link-b", "exec-a", "exec-b", "metering", "metering-b"):
                self.stop(role)
            for log in self.logs.values():
                log.close()
            if hasattr(self, "pg"):
                self.pg.close()
        finally:
            self.network.close()
