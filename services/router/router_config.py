"""Router configuration: deployments, routes and limits, parsed once into frozen objects.

The same validation serves the TOML file (`--config routes.toml`) and the admin API's
SetRoute, so a route that would be refused at start-up is also refused at run time.

    [router]
    default_timeout_s = 30
    [deployments.cpu]
    address = "127.0.0.1:8101"
    path = "cpu-eager"               # the path id the ledger charges
    price_micros_per_hour = 400000   # used by the `cheapest` policy
    [routes.mlp]
    policy = "weighted"              # pinned | weighted | failover | least_loaded | cheapest
    targets = [{deployment = "cpu", weight = 90}, {deployment = "xla", weight = 10}]
    [routes.mlp.shadow]
    share = 0.1
    candidates = [{deployment = "cpu", model = "mlp-perturbed"}]
    [routes.mlp.capture]             # opt-in: a share of requests' inputs kept for trials
    share = 0.05
    max_mb = 64                      # bound on the route's captured files (oldest go first)
    retention = 604800               # seconds a captured workload is kept
"""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.router.capture import CaptureSpec, parse_capture
from switchyard.errors import InvalidArgument


class Policy(enum.StrEnum):
    PINNED = "pinned"
    WEIGHTED = "weighted"
    FAILOVER = "failover"
    LEAST_LOADED = "least_loaded"
    CHEAPEST = "cheapest"


@dataclass(frozen=True)
class Deployment:
    """One executor endpoint; `path` is the accelerator path id used in the ledger."""

    name: str
    address: str
    path: str
    price_micros_per_hour: int = 0


@dataclass(frozen=True)
class Target:
    deployment: str
    model: str = ""  # "" = the route's public model name
    version: str = ""
    weight: float = 1.0

    def label(self, route_model: str) -> str:
        model = self.model or route_model
        return f"{self.deployment}/{model}" + (f":{self.version}" if self.version else "")


@dataclass(frozen=True)
class ShadowSpec:
    share: float
    candidates: tuple[Target, ...]


@dataclass(frozen=True)
class Route:
    model: str
    policy: Policy
    targets: tuple[Target, ...]
    shadow: ShadowSpec | None = None
    max_in_flight: int = 0  # 0 = settings.max_in_flight
    capture: CaptureSpec | None = None  # set in the routes file only (services/router/capture.py)


@dataclass(frozen=True)
class Settings:
    default_timeout_s: float = 30.0
    max_in_flight: int = 256
    # Per principal (services/router/admission.py), 0 = no limit; RouterAdmin overrides them.
    principal_rate_per_s: float = 0.0
    principal_burst: int = 0
    principal_max_in_flight: int = 0
    auth_cache_entries: int = 10_000  # API keys the auth cache holds (least recently used go)
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    # Probes in a row that get no answer within health_timeout_s before the deployment is
    # ejected: a busy executor (a long compile, a big batch) answers late, a dead one refuses
    # (UNAVAILABLE) or says NOT_SERVING, which ejects at once (Envoy's unhealthy_threshold).
    health_timeouts_to_eject: int = 3
    # A deployment that has answered neither a probe nor a request for this long is ejected
    # whatever the count above: a blackholed host (every packet dropped, no RST) must be out
    # within this bound, not after TCP's own timeout (Envoy's outlier detection).
    eject_unanswered_s: float = 2.0
    eject_base_s: float = 1.0  # first cooldown; doubles per consecutive ejection
    eject_max_s: float = 30.0
    auth_cache_ttl_s: float = 2.0  # a revoked key stops working within this (+ one RPC)
    auth_stale_s: float = 300.0  # cached identities keep working this long while metering is down
    require_auth: bool = True
    spool_dir: str = "var/router-spool"
    # Usage goes to metering in one transaction per flush: fewer, larger batches cost the ledger
    # far less per event (its per-batch work is milliseconds), and each flush's burst of work
    # lands on a request or two, so frequent flushes widen the tail. At risk on a crash (not a
    # stop, which flushes): events of the last interval.
    usage_flush_s: float = 0.25
    usage_batch: int = 1000
    # Each answered request's usage is written to a journal before the answer goes (so a killed
    # router loses none); true also fdatasyncs it, to survive the host losing power, at one disk
    # flush per group of requests in flight (services/router/spool_journal.py).
    usage_journal_sync: bool = False
    # The spool's bound on disk; from spool_alarm_fraction of it the router logs an alarm and
    # reports NOT_SERVING until the spool has drained (services/router/spool.py).
    spool_max_mb: int = 1024
    spool_alarm_fraction: float = 0.8
    # Room kept on the spool's disk (a file, `reserve.bin`): when the disk refuses a write, it is
    # freed for the journal of the requests in flight and new metered requests are refused with
    # RESOURCE_EXHAUSTED until the disk has twice this free again (services/router/spool_reserve.py).
    spool_reserve_kb: int = 1024
    evaluator: str = ""  # address of the evaluator service; "" = compare locally
    shadow_atol: float = 1e-5
    shadow_rtol: float = 1e-4
    shadow_max_pending: int = 64  # mirrored requests in flight; beyond that a mirror is skipped
    # How inference reaches executors: "frames" (services.frames, where the executor offers
    # them; gRPC streams until connected and for executors that do not) or "grpc" (streams only).
    executor_transport: str = "frames"
    # Routers with the same fleet name share RouterAdmin route changes through metering; each
    # polls for the others' changes this often (0: never, only its own changes apply).
    # The OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on this
    # port of the router's host (OpenAI's clients expect 8000): -1 = off, 0 = any free port.
    openai_port: int = -1
    fleet: str = "default"
    route_sync_s: float = 2.0
    workloads_dir: str = "var/workloads"  # captured workloads, one folder per route


TRANSPORTS = ("frames", "grpc")


@dataclass(frozen=True)
class RouterConfig:
    settings: Settings = field(default_factory=Settings)
    deployments: tuple[Deployment, ...] = ()
    routes: tuple[Route, ...] = ()

    def deployment(self, name: str) -> Deployment:
        for d in self.deployments:
            if d.name == name:
                return d
        raise InvalidArgument(
            f"unknown deployment {name!r}; known: {sorted(d.name for d in self.deployments)}"
        )


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise InvalidArgument(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _target(raw: Any, where: str) -> Target:
    if isinstance(raw, str):
        return Target(raw)
    if not isinstance(raw, Mapping) or "deployment" not in raw:
        raise InvalidArgument(f"{where}: a target is a deployment name or a table with `deployment`")
    _check_keys(raw, {"deployment", "model", "version", "weight"}, where)
    return Target(
        str(raw["deployment"]),
        str(raw.get("model", "")),
        str(raw.get("version", "")),
        float(raw.get("weight", 1.0)),
    )


def validate_route(route: Route, deployments: tuple[Deployment, ...]) -> Route:
    """Refuses a route that could not serve; returns it unchanged otherwise."""
    where = f"route {route.model!r}"
    names = {d.name: d for d in deployments}
    if not route.model:
        raise InvalidArgument("a route needs the model name callers use")
    if not route.targets:
        raise InvalidArgument(f"{where}: needs at least one target")
    for t in (*route.targets, *(route.shadow.candidates if route.shadow else ())):
        if t.deployment not in names:
            raise InvalidArgument(f"{where}: unknown deployment {t.deployment!r}; known: {sorted(names)}")
    _check_policy(route, names, where)
    if route.shadow is not None:
        if not 0.0 <= route.shadow.share <= 1.0:
            raise InvalidArgument(f"{where}: shadow share must be within 0..1, got {route.shadow.share}")
        if not route.shadow.candidates:
            raise InvalidArgument(f"{where}: shadow needs at least one candidate")
    if route.max_in_flight < 0:
        raise InvalidArgument(f"{where}: max_in_flight must be >= 0")
    return route


def _check_policy(route: Route, deployments: Mapping[str, Deployment], where: str) -> None:
    """Refuses targets the route's policy cannot choose among."""
    if route.policy is Policy.PINNED and len(route.targets) != 1:
        raise InvalidArgument(f"{where}: policy pinned takes exactly one target, got {len(route.targets)}")
    if route.policy is Policy.WEIGHTED and any(t.weight <= 0 for t in route.targets):
        raise InvalidArgument(f"{where}: weighted targets need a weight > 0")
    if route.policy is Policy.CHEAPEST:
        unpriced = [
            t.deployment for t in route.targets if deployments[t.deployment].price_micros_per_hour <= 0
        ]
        if unpriced:
            raise InvalidArgument(f"{where}: policy cheapest needs price_micros_per_hour on {unpriced}")


def route_table(route: Route) -> dict[str, Any]:
    """A route as its config-file table (what `route_from_table` reads back)."""

    def target(t: Target) -> dict[str, Any]:
        return {"deployment": t.deployment, "model": t.model, "version": t.version, "weight": t.weight}

    table: dict[str, Any] = {
        "policy": route.policy.value,
        "targets": [target(t) for t in route.targets],
        "max_in_flight": route.max_in_flight,
    }
    if route.shadow is not None:
        candidates = [target(c) for c in route.shadow.candidates]
        table["shadow"] = {"share": route.shadow.share, "candidates": candidates}
    return table


def route_from_table(model: str, raw: Any, deployments: tuple[Deployment, ...]) -> Route:
    where = f"routes.{model}"
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{where} must be a table")
    _check_keys(raw, {"policy", "targets", "shadow", "max_in_flight", "capture"}, where)
    try:
        policy = Policy(str(raw.get("policy", "failover")))
    except ValueError:
        raise InvalidArgument(
            f"{where}: unknown policy {raw.get('policy')!r}; use one of {[p.value for p in Policy]}"
        ) from None
    targets = tuple(_target(t, where) for t in raw.get("targets", ()))
    shadow = None
    if "shadow" in raw:
        s = raw["shadow"]
        _check_keys(s, {"share", "candidates"}, f"{where}.shadow")
        shadow = ShadowSpec(
            float(s.get("share", 0.0)), tuple(_target(c, where) for c in s.get("candidates", ()))
        )
    capture = parse_capture(raw["capture"], where) if "capture" in raw else None
    route = Route(model, policy, targets, shadow, int(raw.get("max_in_flight", 0)), capture)
    return validate_route(route, deployments)


def _check_spool(settings: Settings) -> None:
    if settings.spool_max_mb < 1 or not 0 < settings.spool_alarm_fraction <= 1:
        raise InvalidArgument(
            "[router] spool_max_mb must be >= 1 and spool_alarm_fraction in (0, 1], got "
            f"{settings.spool_max_mb} and {settings.spool_alarm_fraction}"
        )
    if settings.spool_reserve_kb < 0:
        raise InvalidArgument(f"[router] spool_reserve_kb must be >= 0, got {settings.spool_reserve_kb}")


def parse(raw: Mapping[str, Any]) -> RouterConfig:
    _check_keys(raw, {"router", "deployments", "routes"}, "config")
    settings_raw = dict(raw.get("router", {}))
    allowed = {f.name for f in fields(Settings)}
    _check_keys(settings_raw, allowed, "[router]")
    defaults = Settings()
    typed: dict[str, Any] = {}
    for key, value in settings_raw.items():
        expected = type(getattr(defaults, key))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected):
            raise InvalidArgument(f"[router] {key} must be {expected.__name__}, got {value!r}")
        typed[key] = value
    settings = Settings(**typed)
    if settings.executor_transport not in TRANSPORTS:
        raise InvalidArgument(
            f"[router] executor_transport must be one of {list(TRANSPORTS)}, "
            f"got {settings.executor_transport!r}"
        )
    if not settings.fleet or len(settings.fleet) > 200:
        raise InvalidArgument(f"[router] fleet must be a name of 1..200 characters, got {settings.fleet!r}")
    _check_spool(settings)
    if settings.health_timeouts_to_eject < 1:
        raise InvalidArgument(
            "[router] health_timeouts_to_eject must be >= 1 (1: the first timed-out probe ejects), "
            f"got {settings.health_timeouts_to_eject}"
        )
    if settings.eject_unanswered_s <= 0:
        raise InvalidArgument(
            f"[router] eject_unanswered_s must be > 0 seconds, got {settings.eject_unanswered_s}"
        )
    if settings.route_sync_s < 0:
        raise InvalidArgument(
            f"[router] route_sync_s must be >= 0 (0: no polling), got {settings.route_sync_s}"
        )
    deployments = []
    for name, d in dict(raw.get("deployments", {})).items():
        _check_keys(d, {"address", "path", "price_micros_per_hour"}, f"deployments.{name}")
        if "address" not in d:
            raise InvalidArgument(f"deployments.{name}: needs `address` (host:port of the executor)")
        deployments.append(
            Deployment(
                name, str(d["address"]), str(d.get("path", name)), int(d.get("price_micros_per_hour", 0))
            )
        )
    deps = tuple(deployments)
    routes = tuple(route_from_table(model, r, deps) for model, r in dict(raw.get("routes", {})).items())
    return RouterConfig(settings, deps, routes)


def load(path: Path) -> RouterConfig:
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"route config {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"route config {path} is not valid TOML: {exc}") from None
    return parse(raw)
