"""Deployment state (health, reported load, measured service time) and the routing policies.

Pure domain code: no grpc. Load is what executors report in their responses (`in_flight`,
`queue_depth`) and through GetLoad, never a counter the router keeps, so several router
replicas see the same picture (docs/architecture.md#routing-and-load). Ties are broken at random.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.router.router_config import Deployment, Policy, Route, Settings, Target
from switchyard.errors import Unavailable

# Share of `cheapest` choices spent re-measuring another target, so measurements stay fresh.
EXPLORE_SHARE = 0.05
# Weight of the newest sample in the service-time moving average.
EWMA_ALPHA = 0.2


@dataclass
class DeploymentState:
    """What the router knows about one deployment; mutated only on the event loop."""

    deployment: Deployment
    ejected_until: float = 0.0
    ejections: int = 0  # consecutive; resets after a healthy spell
    admitted_since: float = 0.0
    probe_timeouts: int = 0  # health probes in a row that got no answer in time
    last_error: str = ""
    in_flight: int = 0
    queue_depth: int = 0
    load_at: float = 0.0
    answered_at: float = 0.0  # its last passing probe or reported load (monotonic; 0 = never)
    service_time_us: float = 0.0  # 0 = not measured yet

    def admitted(self) -> bool:
        # An ejected deployment stays out after its cooldown until a health probe passes, so no
        # request is the one that finds out whether it came back.
        return self.ejected_until == 0.0

    def eject(self, reason: str, settings: Settings, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.admitted() and now < self.ejected_until:
            return  # already out and cooling down; a burst of failures is one ejection
        if self.admitted() and now - self.admitted_since > settings.eject_max_s:
            self.ejections = 0  # it had been healthy for long: start the cooldown over
        self.ejections += 1
        cooldown = min(settings.eject_base_s * 2 ** (self.ejections - 1), settings.eject_max_s)
        self.ejected_until = now + cooldown
        self.last_error = reason

    def probe_timed_out(self, settings: Settings) -> bool:
        """A health probe got no answer in time; True when that makes
        `health_timeouts_to_eject` in a row (eject it). A busy executor answers late; only a
        run of late answers says it is stuck."""
        self.probe_timeouts += 1
        return self.probe_timeouts >= settings.health_timeouts_to_eject

    def probe_succeeded(self, now: float | None = None) -> bool:
        """A health probe passed; re-admits once the cooldown is over. True if re-admitted."""
        now = time.monotonic() if now is None else now
        self.probe_timeouts = 0
        self.answered_at = now
        if self.ejected_until and now >= self.ejected_until:
            self.ejected_until = 0.0
            self.admitted_since = now
            return True
        return False

    def report_load(self, in_flight: int, queue_depth: int) -> None:
        self.in_flight, self.queue_depth, self.load_at = in_flight, queue_depth, time.monotonic()
        self.answered_at = self.load_at

    def silent_for(self, now: float) -> float:
        """Seconds since it last answered (0 before it ever has: start-up counts probes)."""
        return now - self.answered_at if self.answered_at else 0.0

    def observe_service_time(self, micros: float) -> None:
        if self.service_time_us == 0.0:
            self.service_time_us = micros
        else:
            self.service_time_us += EWMA_ALPHA * (micros - self.service_time_us)

    @property
    def load(self) -> int:
        return self.in_flight + self.queue_depth

    def cost(self) -> float:
        """Price x measured service time (micro-units per request, up to a constant)."""
        return self.deployment.price_micros_per_hour * self.service_time_us


Choice = tuple[Target, DeploymentState]


def _weighted(options: list[Choice], rng: random.Random) -> Choice:
    return rng.choices(options, weights=[t.weight for t, _ in options])[0]


def _least_loaded(options: list[Choice], rng: random.Random) -> Choice:
    if len(options) == 1:
        return options[0]
    a, b = rng.sample(options, 2)  # power of two choices
    if a[1].load == b[1].load:
        return a  # the sample order is already random: a random tie-break
    return a if a[1].load < b[1].load else b


def _cheapest(options: list[Choice], rng: random.Random) -> Choice:
    unmeasured = [o for o in options if o[1].service_time_us == 0.0]
    if unmeasured:
        return rng.choice(unmeasured)  # measure before judging
    if len(options) > 1 and rng.random() < EXPLORE_SHARE:
        return rng.choice(options)
    best = min(o[1].cost() for o in options)
    return rng.choice([o for o in options if o[1].cost() == best])


def plan(
    route: Route,
    states: Mapping[str, DeploymentState],
    rng: random.Random,
) -> list[Choice]:
    """Targets to try in order: the policy's choice first, then one alternative for a retry."""
    options = [(t, states[t.deployment]) for t in route.targets if states[t.deployment].admitted()]
    if not options:
        ejected = ", ".join(f"{t.deployment} ({states[t.deployment].last_error})" for t in route.targets)
        raise Unavailable(f"no healthy deployment for model {route.model!r}; ejected: {ejected}")
    if route.policy is Policy.FAILOVER or route.policy is Policy.PINNED:
        return options[:2]
    if route.policy is Policy.WEIGHTED:
        first = _weighted(options, rng)
    elif route.policy is Policy.LEAST_LOADED:
        first = _least_loaded(options, rng)
    else:
        first = _cheapest(options, rng)
    rest = [o for o in options if o is not first]
    return [first, rng.choice(rest)] if rest else [first]
