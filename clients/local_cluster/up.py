"""`switchyard up`: the whole cluster on one machine, with a status table, until Ctrl-C.

`LocalCluster` is the part the demo and the tests reuse: it plans, prepares the state
directory, starts and health-checks every service, writes `cluster.json` (the addresses, for
other commands and tests), and stops everything on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from clients.local_cluster import health
from clients.local_cluster.cluster_config import Config
from clients.local_cluster.plan import (
    Ports,
    ServiceSpec,
    build_plan,
    codec_key_file,
    identities,
    temporal_link,
)
from clients.local_cluster.provision import Provisioning
from clients.local_cluster.readiness import StartupFailed
from clients.local_cluster.supervisor import Supervisor
from switchyard import layout, tls
from switchyard.errors import FailedPrecondition
from switchyard.models.builtins import BUILTIN_NAMES, seed_builtins
from workflows.temporal_codec import ensure_key_file

ROOT = layout.checkout_root()  # None when installed: children import the installed package


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class StatusRow:
    service: str
    address: str
    health: str
    models: str
    restarts: int = 0
    last_exit: str = ""


HEADINGS = ("service", "address", "health", "restarts", "last exit", "models")


def format_table(rows: list[StatusRow]) -> str:
    table = [HEADINGS] + [
        (r.service, r.address, r.health, str(r.restarts), r.last_exit or "-", r.models) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADINGS))]
    lines = []
    for i, vals in enumerate(table):
        lines.append("  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class LocalCluster:
    config: Config
    say: Callable[[str], None] = print
    specs: list[ServiceSpec] = field(default_factory=list)
    ports: Ports | None = None
    supervisor: Supervisor | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    paths: dict[str, str] = field(default_factory=dict)  # backend -> ledger path id
    began: float = field(default_factory=time.monotonic)  # the start-up's origin, for its timeline

    @property
    def state_dir(self) -> Path:
        return self.config.state_dir.resolve()

    def address(self, name: str) -> str:
        for spec in self.specs:
            if spec.name == name:
                return spec.address
        raise FailedPrecondition(f"service {name} is not part of this cluster")

    def _say(self, line: str) -> None:
        self.say(line)

    def prepare(self) -> None:
        """Plans the processes and checks that their ports are free before starting any."""
        self.specs, self.ports = build_plan(self.config, ROOT)
        for spec in self.specs:
            if not spec.address:
                continue
            host, port = spec.address.rsplit(":", 1)
            if host in (self.config.host,) and _port_taken(host, int(port)):
                raise FailedPrecondition(
                    f"port {port} for {spec.name} is in use (another `switchyard up`?); stop it or "
                    f"set a different port in the config (e.g. SWITCHYARD_ROUTER_PORT)"
                )
        openai = self.ports.openai
        if openai > 0 and _port_taken(self.config.host, openai):
            raise FailedPrecondition(
                f"port {openai} for the router's OpenAI API is in use; set another "
                f"(SWITCHYARD_ROUTER_OPENAI_PORT=8010) or turn it off (-1)"
            )
        (self.state_dir / "spool").mkdir(parents=True, exist_ok=True)
        repository = self.config.model_repository
        if not repository.exists() or not any(repository.iterdir()):
            added = seed_builtins(repository)
            self._say(f"model repository {repository}: seeded with the built-ins ({', '.join(added)})")
        else:  # a repository seeded before a built-in joined the defaults (tiny-lm-gen) gets it
            named = {m for spec in self.specs for m in spec.models} & set(BUILTIN_NAMES)
            # none named: none added (an empty list would seed them all, hashing minilm's 90 MB)
            added = seed_builtins(repository, sorted(named)) if named else []
            if added:
                self._say(f"model repository {repository}: added the built-ins {', '.join(added)}")
        self._prepare_identities()
        keys = ensure_key_file(codec_key_file(self.config))  # 0600 in a 0700 folder, kept
        self._say(f"Temporal payloads encrypted: codec keys in {keys} (CLI: --codec-key-file {keys})")

    def _prepare_identities(self) -> None:
        """A local CA and a certificate per service on first start (kept for the next; files
        0600), and the operator's for this process's own calls; or plaintext, said so."""
        if self.config.security.insecure:
            self._say("INSECURE: services talk plaintext and do not check callers (security.insecure)")
            tls.set_default(tls.Security.plaintext())
            return
        pki = self.config.pki_dir.resolve()
        folders = tls.ensure_local_pki(pki, identities(self.config))
        tls.set_default(tls.Security.from_dir(folders["operator"]))
        self._say(
            f"mTLS between services: certificates in {pki} (CLI: {tls.TLS_DIR_ENV}={folders['operator']})"
        )

    def executors(self) -> dict[str, ServiceSpec]:
        return {s.name.removeprefix("executor-"): s for s in self.specs if s.name.startswith("executor-")}

    async def _first_wave_up(self) -> None:
        metering, evaluator = self.address("metering"), self.address("evaluator")
        provision = Provisioning(self.config, self.state_dir, self.executors(), metering, evaluator, self.say)
        await provision.run(self.paths)

    async def start(self) -> None:
        self.prepare()
        self.supervisor = Supervisor(
            self.specs,
            self.state_dir / "logs",
            self.config.temporal.namespace,
            self.config.temporal.task_queue,
            say=self._say,
            on_change=self._write_state,
            origin=self.began,
        )
        self._say(f"starting {len(self.specs)} services (logs in {self.state_dir / 'logs'})")
        await self.supervisor.start(self.stop_event, between=self._first_wave_up)
        self._write_state()
        self.supervisor.start_healing(self.stop_event)

    def _write_state(self) -> None:
        assert self.supervisor is not None
        state = {
            "pid": os.getpid(),
            "services": {
                s.name: {
                    "address": s.address,
                    "pid": self.supervisor.pids().get(s.name),
                    "info": s.info,
                    "path": self.paths.get(s.name.removeprefix("executor-"), ""),
                    "models": list(s.models),
                    "probe": s.probe,  # how `up status` asks it (grpc, temporal, http, process)
                    **self._process_state(s.name),
                }
                for s in self.specs
            },
            "openai_url": self.openai_url(),
            "temporal_ui": next((s.info.removeprefix("UI ") for s in self.specs if s.name == "temporal"), ""),
            "ledger_url": self.config.ledger_url if not self.config.database_url else "(configured)",
            "state_dir": str(self.state_dir),
            "temporal_address": self.config.temporal.address or self.address("temporal"),
            # TLS and the codec's key file, by path (workflows/temporal_link.py): no key material
            "temporal_env": temporal_link(
                self.config, self.config.temporal.address or self.address("temporal")
            ).env(),
            "tls_dir": ""
            if self.config.security.insecure
            else str(self.config.pki_dir.resolve() / "operator"),
        }
        path = self.state_dir / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
        tmp.replace(path)

    def openai_url(self) -> str:
        """The base URL of the router's OpenAI API ("" when it is off)."""
        if self.ports is None or self.ports.openai < 0:
            return ""
        return f"http://{self.config.host}:{self.ports.openai}/v1"

    def _process_state(self, name: str) -> dict[str, object]:
        assert self.supervisor is not None
        child = self.supervisor.children.get(name)
        if child is None:
            return {"state": "not started", "restarts": 0, "last_exit": ""}
        return {
            "state": child.state,
            "restarts": child.restarts,
            "last_exit": child.last_exit,
            "standby": self.supervisor.standby(name),  # ready | starting | "" (none)
        }

    async def status(self) -> list[StatusRow]:
        assert self.supervisor is not None
        rows = []
        for spec in self.specs:
            process = self._process_state(spec.name)
            if process["state"] in ("running", "restarting"):
                status = await self.supervisor.probe(spec)
            else:
                status = str(process["state"]).upper()
            models = "-"
            if spec.models:
                models = health.readiness_summary(await health.executor_models(spec.address))
            elif spec.info:
                models = spec.info
            rows.append(
                StatusRow(
                    spec.name,
                    spec.address or "(task queue)",
                    status,
                    models,
                    int(str(process["restarts"])),
                    str(process["last_exit"]),
                )
            )
        return rows

    async def stop(self) -> None:
        if self.supervisor is not None:
            self._say("stopping: draining the router first, then every service")
            await self.supervisor.stop()
        (self.state_dir / "cluster.json").unlink(missing_ok=True)
        tls.set_default(None)

    async def __aenter__(self) -> LocalCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def install_stop_signals(event: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)


async def serve_until_stopped(cluster: LocalCluster) -> int:
    """Prints the status table, then serves, healing crashed services, until Ctrl-C/SIGTERM."""
    assert cluster.supervisor is not None
    print(format_table(await cluster.status()), flush=True)
    took = time.monotonic() - cluster.began
    print(f"cluster is up after {took:.1f}s; Ctrl-C stops it (`switchyard up status` shows it meanwhile)",
          flush=True)  # fmt: skip
    await cluster.stop_event.wait()
    return 0


def probe_of(name: str, service: dict[str, Any]) -> str:
    """How a service of cluster.json is probed (a file from before it said so: by its name)."""
    return str(service.get("probe") or ("temporal" if name == "temporal" else "grpc"))


async def status_rows(state_dir: Path) -> list[StatusRow]:
    """The table of a running cluster, from its cluster.json and live probes."""
    path = state_dir / "cluster.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FailedPrecondition(
            f"no cluster is running with state directory {state_dir} ({path} is missing); "
            "start one with `switchyard up`, or pass its --config / --state-dir"
        ) from None
    if state.get("tls_dir") and not os.environ.get(tls.TLS_DIR_ENV):
        tls.set_default(tls.Security.from_dir(state["tls_dir"]))  # the operator's certificate
    rows = []
    for name, s in state["services"].items():
        address = s.get("address") or ""
        process = str(s.get("state", "running"))
        if process not in ("running", "restarting"):
            status = process.upper()
        elif not address:
            status = "-"
        elif probe_of(name, s) == "temporal":
            status = await health.temporal_health(address)
        elif probe_of(name, s) == "http":  # the audit witness, the Temporal UI's codec endpoint
            status = await health.http_health(address)
        else:  # the router's port is public: plaintext unless it serves TLS itself
            public = tls.Security.plaintext() if name == "router" else None
            status = await health.grpc_health(address, security=public, expect=name)
        models = s.get("info") or "-"
        if s.get("models"):
            models = health.readiness_summary(await health.executor_models(address))
        rows.append(
            StatusRow(
                name,
                address or "(task queue)",
                status,
                models,
                int(s.get("restarts", 0)),
                str(s.get("last_exit", "")),
            )
        )
    return rows


@contextlib.asynccontextmanager
async def started(config: Config, began: float | None = None) -> AsyncIterator[LocalCluster]:
    """A started LocalCluster, stopped when the block ends however it ends; Ctrl-C or SIGTERM
    sets its `stop_event`, during the start as well. `began`: when the start began (monotonic;
    default now), the origin of the start-up timeline it prints."""
    cluster = LocalCluster(config)
    if began is not None:
        cluster.began = began
    install_stop_signals(cluster.stop_event)
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.stop()


async def up(config: Config, began: float | None = None) -> int:
    try:
        async with started(config, began) as cluster:
            if cluster.stop_event.is_set():
                return 130
            return await serve_until_stopped(cluster)
    except StartupFailed as exc:
        print(f"switchyard up failed: {exc}", file=sys.stderr)
        return 1
