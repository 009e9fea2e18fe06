"""The usage meter: one usage event per request (and per shadow copy), and the router's metrics.

Every request the router admitted is charged once, whatever happened to it: its `Outcome`
(completed, failed, cancelled), the path that answered it, its share of the device time the
executor reported, and for generations the prompt and output tokens. A request refused before
a deployment was chosen (the route's in-flight bound) is charged to the route's first path, as
failed. Events go to the spool (batched and spooled to disk while metering is down); the
idempotency key is the request id (a shadow copy's adds its arm and candidate), so a retried
flush is stored once. Each event is in the spool's journal on disk before the router answers
(`durable`). The same outcome feeds the Prometheus counters (`RouterStats`). The records
(`Outcome`, `Charge`) are the stages' shared ones (`request_records`).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.router.policies import DeploymentState
from services.router.request_records import Charge, Outcome, now_us
from services.router.router_metrics import RouterStats
from services.router.spool import Spool
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb


def tags_key(tags: dict[str, str] | None) -> str:
    return (tags or {}).get("candidate", "")


class UsageMeter:
    def __init__(self, spool: Spool | None, states: Mapping[str, DeploymentState]) -> None:
        self.spool = spool
        self._states = states
        self.stats = RouterStats()  # read by the Prometheus collector (services/router/router_metrics.py)

    def record(
        self,
        charge: Charge,
        outcome: Outcome,
        arm: str = "primary",
        tags: dict[str, str] | None = None,
    ) -> None:
        """The usage event of one request (`arm` "primary") or shadow copy ("shadow"), with a
        generation's prompt and output tokens (0, unset, for other models)."""
        if self.spool is None:
            return
        route, started_us = charge.route, charge.started_us
        ended_us = max(now_us(), started_us)
        # A request refused before a deployment was chosen is charged to the route's first path.
        path = outcome.path or self._states[route.targets[0].deployment].deployment.path
        key = charge.request_id if arm == "primary" else f"{charge.request_id}:{arm}:{tags_key(tags)}"
        event = mpb.UsageEvent(
            idempotency_key=key,
            path=path,
            model=route.model,
            model_version=charge.header.model_version,
            team=charge.identity.team,
            principal=charge.identity.principal_id,
            kind="request",
            status=outcome.status,
            met_quality=outcome.status == "completed",
            busy_us=min(outcome.busy_us, ended_us - started_us),
            started_unix_us=started_us,
            ended_unix_us=ended_us,
            arm=arm,
            prompt_tokens=outcome.prompt_tokens,
            output_tokens=outcome.output_tokens,
        )
        if tags:
            event.tags.update(tags)
        self.spool.usage(event)

    async def durable(self) -> None:
        """Returns once the usage recorded so far is on disk: await it before answering."""
        if self.spool is not None:
            await self.spool.durable()

    def observe(
        self, charge: Charge, outcome: Outcome, duration_s: float, overhead_s: float | None = None
    ) -> None:
        """The request's counters, latency and, when it was answered, the router's own time
        (`overhead_s`), for Prometheus: once a request, as it leaves."""
        route, team = charge.route, charge.identity.team
        self.stats.record(route.model, outcome.path, team, outcome.status, duration_s, overhead_s)
