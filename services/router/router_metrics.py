"""The router's Prometheus metrics: requests per route (model), path and team, latency and
router overhead per route and path, deployments' health, and the usage spool.

Per request the router adds to plain counters on its event loop (`RouterStats.record`); the
families are built when Prometheus scrapes (`collector`).

- `switchyard_router_requests_total{model,path,team,status}` (counter; status completed,
  failed or cancelled).
- `switchyard_router_request_duration_seconds{model,path}` (histogram).
- `switchyard_router_overhead_seconds{model,path}` (histogram): the router's own time, its
  duration less the upstream waits.
- `switchyard_router_in_flight{model}` (gauge).
- `switchyard_router_deployment_admitted{deployment,path}` (gauge): 1 routed to, 0 ejected.
- `switchyard_router_spool_depth` (gauge): usage and audit segments on disk for metering.
- `switchyard_router_spool_events_total{outcome}`: sent, spooled, replayed, dead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from services.router.policies import DeploymentState
from services.router.spool import Spool
from switchyard.metrics_endpoint import CallbackCollector, Histogram, counter, gauge


class RouterStats:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str, str], int] = {}
        self.duration = Histogram()
        self.overhead = Histogram()

    def record(
        self, model: str, path: str, team: str, status: str, duration_s: float, overhead_s: float | None
    ) -> None:
        """One request as it leaves; `overhead_s` None for one that got no answer."""
        key = (model, path, team, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        self.duration.observe((model, path), duration_s)
        if overhead_s is not None:
            self.overhead.observe((model, path), overhead_s)


class Observed(Protocol):
    """What the metrics read of the router (its request path): counters kept per request, the
    routes' in-flight counts, the deployments' states and the usage spool."""

    @property
    def stats(self) -> RouterStats: ...

    @property
    def in_flight(self) -> Mapping[str, int]: ...

    @property
    def states(self) -> Mapping[str, DeploymentState]: ...

    @property
    def spool(self) -> Spool | None: ...


def collector(path: Observed) -> CallbackCollector:
    return CallbackCollector(lambda: families(path))


def families(path: Observed) -> Iterable[Any]:
    stats = path.stats
    requests = counter(
        "switchyard_router_requests_total", "Requests answered, by route, path and team",
        ("model", "path", "team", "status"),
    )  # fmt: skip
    for key, n in list(stats.requests.items()):
        requests.add(key, n)
    in_flight = gauge("switchyard_router_in_flight", "Requests in the router per route", ("model",))
    for model, n in list(path.in_flight.items()):
        in_flight.add_metric([model], n)
    admitted = gauge(
        "switchyard_router_deployment_admitted", "1 while a deployment is routed to, 0 while ejected",
        ("deployment", "path"),
    )  # fmt: skip
    for name, state in list(path.states.items()):
        admitted.add_metric([name, state.deployment.path], 1.0 if state.admitted() else 0.0)
    found: list[Any] = [
        requests,
        stats.duration.family(
            "switchyard_router_request_duration_seconds", "Request duration in the router", ("model", "path")
        ),
        stats.overhead.family(
            "switchyard_router_overhead_seconds",
            "The router's own time per request (its duration less the upstream wait)",
            ("model", "path"),
        ),
        in_flight,
        admitted,
    ]
    spool = path.spool
    if spool is not None:
        depth = gauge("switchyard_router_spool_depth", "Usage and audit segments on disk for metering", ())
        depth.add_metric([], spool.backlog)
        events = counter("switchyard_router_spool_events_total", "Usage events by outcome", ("outcome",))
        s = spool.stats
        for outcome, n in (
            ("sent", s.sent_events),
            ("spooled", s.spooled_events),
            ("replayed", s.replayed_events),
            ("dead", s.dead_events),
        ):
            events.add((outcome,), n)
        refusing = gauge(
            "switchyard_router_spool_refusing", "1 while the spool's disk has no room and new metered "
            "requests are refused", (),
        )  # fmt: skip
        refusing.add_metric([], 1.0 if spool.refusal else 0.0)
        refused = counter(
            "switchyard_router_spool_refused_requests_total",
            "Metered requests refused (RESOURCE_EXHAUSTED) while the spool's disk had no room", (),
        )  # fmt: skip
        refused.add((), s.refused_requests)
        found += [depth, events, refusing, refused]
    return found
