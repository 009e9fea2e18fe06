"""Cluster configuration: one TOML document, embedded defaults, file, then environment.

Precedence, lowest first: the defaults embedded below, a TOML file (`--config FILE` or
`SWITCHYARD_CONFIG`), then `SWITCHYARD_<SECTION>_<KEY>` environment variables (for
executors `SWITCHYARD_EXECUTORS_<BACKEND>_<KEY>`). The result is parsed once, at the edge,
into frozen dataclasses; unknown keys and wrong types are rejected with the key named.

The same settings drive one machine and a real cluster: an empty `database.url` means a
SQLite ledger under `state_dir`, a PostgreSQL URL is passed through unchanged; an empty
`temporal.address` means `switchyard up` starts the Temporal dev server, a `host:port`
means a remote Temporal and no dev server.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.errors import InvalidArgument

ENV_PREFIX = "SWITCHYARD_"

# Environment variables that predate this module keep working: the Makefile exports the XLA
# interpreter as SWITCHYARD_XLA_PYTHON, and the metering service reads SWITCHYARD_DATABASE_URL.
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "SWITCHYARD_XLA_PYTHON": ("executors", "xla", "python"),
    "SWITCHYARD_TPU_PYTHON": ("executors", "tpu", "python"),
    # The trial worker's variable for the same address (clients/trial_cli.py).
    "SWITCHYARD_TEMPORAL": ("temporal", "address"),
    # The services' own telemetry variables (switchyard/telemetry.py).
    "SWITCHYARD_TRACES": ("telemetry", "exporter"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("telemetry", "otlp_endpoint"),
}

DEFAULT_TOML = """
state_dir = "var/cluster"      # ledger, Temporal database, logs, spool (relative to the cwd)
host = "127.0.0.1"             # address every local service binds

[database]
url = ""                       # "" = sqlite:///<state_dir>/ledger.db; or postgresql+psycopg://...

[temporal]
address = ""                   # "" = start the dev server here; or host:port of a Temporal cluster
namespace = "default"
port = 7233
ui_port = 8233
task_queue = "switchyard-trials"
codec_key_file = ""            # "" = <state_dir>/keys/temporal-codec.key, made on first start
codec_port = 0                 # the Temporal UI's codec endpoint (/encode, /decode); 0 = any free
tls = false                    # true = TLS to a remote Temporal, its CA one the system trusts
tls_ca = ""                    # a remote Temporal's CA: every connection to it uses TLS
tls_cert = ""                  # client certificate and key, where it asks for mTLS
tls_key = ""
tls_server_name = ""           # the name its certificate carries, if not the address's host

[metering]
port = 8201

[witness]
port = 0                       # the audit witness that countersigns the ledger's head; only
                               # metering dials it, so 0 = any free port; -1 = none

[evaluator]
port = 8301

[router]
port = 8001
routes_file = ""               # "" = routes derived from the executors started here
shadow_share = 0.2             # share of requests mirrored to the shadow path in derived routes
openai_port = 8000             # the OpenAI-compatible HTTP API; -1 = off, 0 = any free port

[worker]
enabled = true

[security]
insecure = false               # true = plaintext between services, callers unchecked (tests only)
pki_dir = ""                   # "" = <state_dir>/tls: a local CA and a certificate per service

[telemetry]
exporter = "none"              # none | otlp | console (a debugging switch: spans in each service's log)
otlp_endpoint = ""

[models]
repository = "var/models"      # the model repository every executor and the worker load from;
                               # created and seeded with the built-ins when missing

[executors]
allowed_factories = []         # packages whose factory-format models executors may import

[executors.cpu]
enabled = "true"
port = 8101
models = ["mlp", "tiny-lm", "minilm-l6", "tiny-lm-gen"]  # tiny-lm-gen: generative, for the OpenAI API
mode = ""                      # "" = the backend's default mode
python = ""                    # "" = the interpreter running switchyard

[executors.xla]
enabled = "auto"               # auto = when its interpreter exists
port = 8102
models = ["mlp", "tiny-lm"]
mode = ""
python = ""

[executors.cuda]
enabled = "auto"               # auto = when an NVIDIA device node exists
port = 8103
models = ["mlp", "tiny-lm", "minilm-l6"]
mode = ""
python = ""

[executors.tpu]
enabled = "auto"               # auto = when a TPU device node and its interpreter exist
port = 8104
models = ["mlp", "tiny-lm"]
mode = ""
python = ""
"""


class ConfigError(InvalidArgument):
    """A configuration value is missing, unknown or of the wrong type."""


@dataclass(frozen=True)
class TemporalConfig:
    address: str
    namespace: str
    port: int
    ui_port: int
    task_queue: str
    codec_key_file: str = ""  # "" = <state_dir>/keys/temporal-codec.key
    codec_port: int = 0
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    @property
    def local(self) -> bool:
        """True when `switchyard up` runs the dev server itself."""
        return not self.address


@dataclass(frozen=True)
class RouterConfig:
    port: int
    routes_file: str
    shadow_share: float
    openai_port: int = -1  # -1 = no OpenAI API, 0 = any free port


@dataclass(frozen=True)
class SecurityConfig:
    insecure: bool
    pki_dir: str  # "" = <state_dir>/tls


@dataclass(frozen=True)
class TelemetryConfig:
    exporter: str
    otlp_endpoint: str


@dataclass(frozen=True)
class ExecutorConfig:
    backend: str
    enabled: str  # "true" | "false" | "auto"
    port: int
    models: tuple[str, ...]
    mode: str
    python: str


@dataclass(frozen=True)
class Config:
    state_dir: Path
    host: str
    database_url: str
    temporal: TemporalConfig
    metering_port: int
    evaluator_port: int
    router: RouterConfig
    worker_enabled: bool
    telemetry: TelemetryConfig
    executors: tuple[ExecutorConfig, ...]
    model_repository: Path = Path("var/models")
    allowed_factories: tuple[str, ...] = ()
    security: SecurityConfig = SecurityConfig(insecure=False, pki_dir="")
    witness_port: int = -1  # the audit witness (services/witness); -1 = none, 0 = any free port

    @property
    def pki_dir(self) -> Path:
        """Where `switchyard up` keeps its CA and the services' certificates."""
        return Path(self.security.pki_dir) if self.security.pki_dir else self.state_dir / "tls"

    @property
    def ledger_url(self) -> str:
        """The database URL metering is given: the configured one or the SQLite file."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.state_dir / 'ledger.db').resolve()}"

    def executor(self, backend: str) -> ExecutorConfig:
        for ex in self.executors:
            if ex.backend == backend:
                return ex
        raise ConfigError(f"no executor section [executors.{backend}] in the configuration")


def _merge(base: dict[str, Any], over: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Deep-merges `over` into a copy of `base`; keys must already exist (typos fail loudly)."""
    out = dict(base)
    for key, value in over.items():
        name = f"{where}.{key}" if where else key
        if key not in base:
            raise ConfigError(f"unknown configuration key '{name}'")
        if isinstance(value, Mapping):
            current = base.get(key, {})
            if not isinstance(current, dict):
                raise ConfigError(f"'{name}' must be a value, not a table")
            out[key] = _merge(current, value, name)
        else:
            out[key] = value
    return out


def _parse_env_value(name: str, raw: str, current: Any) -> Any:
    """Converts an environment string to the type of the value it overrides."""
    try:
        if isinstance(current, bool):
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return low in ("1", "true", "yes")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, list):
            return [item.strip() for item in raw.split(",") if item.strip()]
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r}: expected a {type(current).__name__}") from exc
    return raw


def _env_targets(tree: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Environment variable name -> key path, for every key of the document."""
    targets: dict[str, tuple[str, ...]] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            for sub, subval in value.items():
                if isinstance(subval, dict):
                    for leaf in subval:
                        targets[f"{ENV_PREFIX}{key}_{sub}_{leaf}".upper()] = (key, sub, leaf)
                else:
                    targets[f"{ENV_PREFIX}{key}_{sub}".upper()] = (key, sub)
        else:
            targets[f"{ENV_PREFIX}{key}".upper()] = (key,)
    return targets


def env_names() -> set[str]:
    """Every environment variable the configuration reads (for checks of deploy files)."""
    return {f"{ENV_PREFIX}CONFIG", *ENV_ALIASES, *_env_targets(tomllib.loads(DEFAULT_TOML))}


def _env_overrides(tree: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Applies SWITCHYARD_* variables to the known keys of `tree` (a merged document)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    targets = _env_targets(tree)
    # Aliases apply first so that the canonical name wins when both are set.
    ordered = [(alias, path) for alias, path in ENV_ALIASES.items()]
    ordered += list(targets.items())
    for name, path in ordered:
        if name not in env:
            continue
        node: dict[str, Any] = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                break
            child = {k: (dict(v) if isinstance(v, dict) else v) for k, v in child.items()}
            node[part] = child
            node = child
        else:
            if path[-1] in node:
                node[path[-1]] = _parse_env_value(name, env[name], node[path[-1]])
    return out


def _get(tree: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = tree.get(key)
    name = f"{where}.{key}" if where else key
    # bool is an int subclass: keep them apart so `port = true` is an error.
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"'{name}' must be a {kind.__name__}, got {value!r}")
    return value


def _port(tree: Mapping[str, Any], where: str, key: str = "port") -> int:
    port = int(_get(tree, key, int, where))
    if not 0 <= port <= 65535:
        raise ConfigError(f"'{where}.{key}' must be between 0 and 65535, got {port}")
    return port


def _executor(backend: str, tree: Mapping[str, Any]) -> ExecutorConfig:
    where = f"executors.{backend}"
    unknown = set(tree) - {"enabled", "port", "models", "mode", "python"}
    if unknown:
        raise ConfigError(f"unknown configuration key '{where}.{sorted(unknown)[0]}'")
    enabled = tree.get("enabled", "auto")
    enabled = str(enabled).lower() if isinstance(enabled, bool | str) else enabled
    if enabled not in ("true", "false", "auto"):
        raise ConfigError(f"'{where}.enabled' must be true, false or \"auto\", got {enabled!r}")
    models = tree.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"'{where}.models' must be a list of model names")
    return ExecutorConfig(
        backend=backend,
        enabled=enabled,
        port=_port(tree, where),
        models=tuple(models),
        mode=str(_get(tree, "mode", str, where)),
        python=str(tree.get("python", "")),
    )


TEMPORAL_TLS_KEYS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name")


def _build(tree: Mapping[str, Any]) -> Config:
    temporal = tree["temporal"]
    router = tree["router"]
    telemetry = tree["telemetry"]
    share = float(_get(router, "shadow_share", float, "router"))
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"'router.shadow_share' must be within [0, 1], got {share}")
    exporter = str(_get(telemetry, "exporter", str, "telemetry"))
    if exporter not in ("none", "console", "otlp"):
        raise ConfigError(f"'telemetry.exporter' must be none, console or otlp, got {exporter!r}")
    url = str(_get(tree["database"], "url", str, "database"))
    if url and not url.startswith(("sqlite", "postgresql")):
        raise ConfigError(
            f"'database.url' must be a sqlite:// or postgresql:// URL, got {url.split(':')[0]}:"
        )
    return Config(
        state_dir=Path(str(_get(tree, "state_dir", str, ""))),
        host=str(_get(tree, "host", str, "")),
        database_url=url,
        temporal=TemporalConfig(
            address=str(_get(temporal, "address", str, "temporal")),
            namespace=str(_get(temporal, "namespace", str, "temporal")),
            port=_port(temporal, "temporal"),
            ui_port=int(_get(temporal, "ui_port", int, "temporal")),
            task_queue=str(_get(temporal, "task_queue", str, "temporal")),
            codec_key_file=str(_get(temporal, "codec_key_file", str, "temporal")),
            codec_port=_port(temporal, "temporal", "codec_port"),
            tls=bool(_get(temporal, "tls", bool, "temporal")),
            **{k: str(_get(temporal, k, str, "temporal")) for k in TEMPORAL_TLS_KEYS},
        ),
        metering_port=_port(tree["metering"], "metering"),
        evaluator_port=_port(tree["evaluator"], "evaluator"),
        router=RouterConfig(
            port=_port(router, "router"),
            routes_file=str(_get(router, "routes_file", str, "router")),
            shadow_share=share,
            openai_port=_port_or_off(router, "openai_port", "router"),
        ),
        worker_enabled=bool(_get(tree["worker"], "enabled", bool, "worker")),
        telemetry=TelemetryConfig(
            exporter=exporter, otlp_endpoint=str(_get(telemetry, "otlp_endpoint", str, "telemetry"))
        ),
        executors=tuple(
            _executor(name, ex) for name, ex in tree["executors"].items() if name != "allowed_factories"
        ),
        model_repository=Path(str(_get(tree["models"], "repository", str, "models"))),
        allowed_factories=_packages(tree["executors"].get("allowed_factories", [])),
        security=SecurityConfig(
            insecure=bool(_get(tree["security"], "insecure", bool, "security")),
            pki_dir=str(_get(tree["security"], "pki_dir", str, "security")),
        ),
        witness_port=_port_or_off(tree["witness"], "port", "witness"),
    )


def _port_or_off(table: Mapping[str, Any], key: str, where: str) -> int:
    port = int(_get(table, key, int, where))
    if not -1 <= port <= 65535:
        raise ConfigError(f"'{where}.{key}' must be -1 (off) or between 0 and 65535, got {port}")
    return port


def _packages(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError("'executors.allowed_factories' must be a list of package names")
    return tuple(value)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults, then the TOML file (argument or SWITCHYARD_CONFIG), then the environment,
    then `overrides` (a nested mapping, used by command-line flags)."""
    env = os.environ if env is None else env
    tree = tomllib.loads(DEFAULT_TOML)
    file = path or env.get(f"{ENV_PREFIX}CONFIG", "")
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {file}: {exc.strerror}") from exc
        try:
            tree = _merge(tree, tomllib.loads(text), "")
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"configuration file {file} is not valid TOML: {exc}") from exc
    tree = _env_overrides(tree, env)
    if overrides:
        tree = _merge(tree, overrides, "")
    return _build(tree)
