"""The router's request path: admit, pick a deployment, forward the bytes, account for it.

`Router.infer` takes the serialized ModelInferRequest and returns the serialized response.
It reads the request header without decoding tensors, forwards `raw + overrides` (model
name/version of the chosen target appended, see `wire`), and appends the router's own
response parameters (`path`, `router_overhead_us`, `request_id`) to the executor's bytes.
Retry: one more deployment when the first answered UNAVAILABLE (the executor did not take
the request: not connected, draining, or gone); OIP inference has no side effects, and only
the attempt that answered is charged. The remaining deadline goes with every call (as
Triton's `timeout` parameter on the executor stream, see `executors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.router import wire
from services.router.auth import ANONYMOUS, Authenticator, Identity, authorize, bearer_key
from services.router.capture import Capturer
from services.router.config import Route, RouterConfig, Target
from services.router.evaluator_client import EvaluatorComparer, EvaluatorUnavailable
from services.router.executors import ExecutorPool
from services.router.limits import Limit, PrincipalLimits
from services.router.metrics import RouterStats
from services.router.paths import PathRegistrar
from services.router.policies import DeploymentState, plan
from services.router.route_store import RouteStore
from services.router.shadow import Divergence, ShadowStats, divergence
from services.router.spool import Spool
from switchyard import authz, ids, oip_params, telemetry
from switchyard.errors import (
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Status,
    SwitchyardError,
    Unauthenticated,
    UpstreamError,
)
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.switchyard.v1 import metering_pb2 as mpb

log = logging.getLogger(__name__)

Metadata = Iterable[Any]  # (key, value) pairs; grpc.aio.Metadata or a plain sequence


@dataclass
class Outcome:
    status: str = "failed"
    path: str = ""
    busy_us: int = 0
    tokens: tuple[int, int] = (0, 0)  # (prompt, output) of a generation answered unary


def _int(params: Any, key: str) -> int:
    return int(params[key].int64_param) if key in params else 0


def tags_key(tags: dict[str, str] | None) -> str:
    return (tags or {}).get("candidate", "")


# Response parameters every executor sets: load for routing, device time for usage.
_LOAD_KEYS = (
    oip_params.IN_FLIGHT, oip_params.QUEUE_DEPTH, oip_params.COMPUTE_US, oip_params.BATCH_SIZE,
    oip_params.NUM_INPUT_TOKENS, oip_params.NUM_OUTPUT_TOKENS,  # generation only; 0 otherwise
)  # fmt: skip


class Router:
    def __init__(
        self,
        config: RouterConfig,
        pool: ExecutorPool,
        auth: Authenticator | None,
        spool: Spool | None,
        store: RouteStore,
        evaluator: EvaluatorComparer | None = None,
        registrar: PathRegistrar | None = None,
    ) -> None:
        self.config = config
        self.settings = config.settings
        self.store = store
        self.registrar = registrar
        self.file_routes = {r.model: r for r in config.routes}
        self.routes: dict[str, Route] = {}
        self._apply_route_changes()
        self.pool = pool
        self.auth = auth
        self.spool = spool
        self.evaluator = evaluator
        self.rng = random.Random()
        self.in_flight: dict[str, int] = {}
        self.limits = PrincipalLimits(
            Limit(
                self.settings.principal_rate_per_s,
                self.settings.principal_burst,
                self.settings.principal_max_in_flight,
            )
        )
        self.shadow_stats: dict[tuple[str, str], ShadowStats] = {}
        self._shadow_pending = 0
        self.stats = RouterStats()  # read by the Prometheus collector (services/router/metrics.py)
        self._background: set[asyncio.Task[None]] = set()
        self.captures: dict[str, Capturer] = {}  # route -> its workload capture (opt-in)
        self._decoupled: dict[str, bool] = {}  # route model -> decoupled (generative)

    # ---- admission ----------------------------------------------------------------------------
    def route_for(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise NotFound(f"unknown model {model!r}; the router serves {sorted(self.routes)}")
        return route

    def _apply_route_changes(self) -> None:
        """The routes in force: the file's, with the run-time changes kept (and shared) since.
        Copy-on-write: requests already running keep the route object they started with."""
        self.routes = self.store.routes(self.file_routes, self.config.deployments)
        if self.registrar is not None:  # the paths the routes now send to, registered with metering
            self.registrar.want_routes(self.routes.values())

    async def set_route(self, route: Route, principal: str = "", request_id: str = "") -> None:
        """Adds or replaces a (validated) route; kept and shared first, so a change that cannot
        be kept is refused (`route_store`)."""
        await self.store.save(route.model, route, self.routes.get(route.model), principal, request_id)
        self._apply_route_changes()

    async def delete_route(self, model: str, principal: str = "", request_id: str = "") -> None:
        old = self.route_for(model)  # NOT_FOUND before anything is kept
        await self.store.save(model, None, old, principal, request_id)
        self._apply_route_changes()

    async def sync_routes(self) -> None:
        """Applies the fleet's newer route changes; raises Unavailable while metering is down."""
        if await self.store.sync():
            self._apply_route_changes()
            log.info("applied the fleet's route changes: %d routes now", len(self.routes))

    def start_route_sync(self, interval_s: float) -> None:
        task = asyncio.create_task(self._sync_routes_every(interval_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sync_routes_every(self, interval_s: float) -> None:
        failing = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync_routes()
            except SwitchyardError as exc:
                if not failing:
                    log.warning("cannot fetch the fleet's route changes from metering, retrying: %s", exc)
                failing = True
                continue
            except Exception:  # a bug here must not stop the polling for good
                log.exception("fetching the fleet's route changes failed; retrying")
                continue
            if failing:
                log.info("fetching the fleet's route changes from metering again")
            failing = False

    async def identify(self, metadata: Metadata, resource: str, request_id: str, peer: str) -> Identity:
        if self.auth is None:
            return ANONYMOUS
        try:
            return await self.auth.identify(bearer_key(metadata))
        except Unauthenticated as exc:
            self.audit_denial(None, resource, str(exc), "UNAUTHENTICATED", request_id, peer)
            raise

    async def admit(self, metadata: Metadata, model: str, request_id: str, peer: str) -> Identity:
        identity = await self.identify(metadata, f"model:{model}", request_id, peer)
        try:
            authorize(identity, model)
        except PermissionDenied as exc:
            self.audit_denial(identity, f"model:{model}", str(exc), "PERMISSION_DENIED", request_id, peer)
            raise
        return identity

    def audit(
        self,
        identity: Identity | None,
        action: str,
        resource: str,
        outcome: str,
        detail_json: str,
        request_id: str,
        peer: str,
    ) -> None:
        if self.spool is None:
            return
        # every string capped: a caller's 64 MiB model name must not become a 64 MiB audit row
        actor = mpb.Actor(
            principal=authz.cap(identity.principal_id if identity else ""),
            source=authz.cap(f"router {peer}".strip()),
            request_id=request_id,
            trace_id=telemetry.current_trace_id(),
        )
        self.spool.audit(
            mpb.AppendAuditRequest(
                actor=actor,
                action=action,
                resource=authz.cap(resource),
                outcome=outcome,
                detail_json=detail_json if len(detail_json) <= authz.MAX_AUDIT_DETAIL else "{}",
            )
        )

    def audit_denial(
        self, identity: Identity | None, resource: str, reason: str, status: str, request_id: str, peer: str
    ) -> None:
        detail = json.dumps({"status": status, "reason": authz.cap(reason, 512)})
        self.audit(identity, "request.denied", resource, "denied", detail, request_id, peer)

    # ---- inference ----------------------------------------------------------------------------
    async def infer(self, raw: bytes, metadata: Metadata, time_remaining: float | None, peer: str) -> bytes:
        t0 = time.perf_counter_ns()
        started_us = time.time_ns() // 1000
        request_id = ids.time_ordered_hex()
        header = wire.read_header(raw)
        route = self.route_for(header.model_name)
        identity = await self.admit(metadata, route.model, request_id, peer)
        # over the principal's limit: refused here, counted, no ledger line (limits.py)
        counted = self.limits.acquire(identity.principal_id)
        try:
            return await self._infer_admitted(
                raw, header, route, identity, request_id, time_remaining, t0, started_us
            )
        finally:
            if counted:
                self.limits.release(identity.principal_id)

    async def _infer_admitted(
        self,
        raw: bytes,
        header: wire.Header,
        route: Route,
        identity: Identity,
        request_id: str,
        time_remaining: float | None,
        t0: int,
        started_us: int,
    ) -> bytes:
        limit = route.max_in_flight or self.settings.max_in_flight
        count = self.in_flight.get(route.model, 0)
        if count >= limit:
            self._usage(route, identity, request_id, header, Outcome(), started_us, "primary")
            raise ResourceExhausted(
                f"model {route.model!r} has {count} requests in flight (limit {limit}); retry with back-off"
            )
        self.in_flight[route.model] = count + 1
        outcome = Outcome()
        try:
            reply, target, wait_ns = await self._forward(route, header, raw, time_remaining, outcome)
        except asyncio.CancelledError:
            outcome.status = "cancelled"
            raise
        finally:
            self.in_flight[route.model] -= 1
            self._usage(route, identity, request_id, header, outcome, started_us, "primary")
            self.stats.record(
                route.model, outcome.path, identity.team, outcome.status, (time.perf_counter_ns() - t0) / 1e9
            )
        if route.shadow is not None and self.rng.random() < route.shadow.share:
            self._mirror(route, header, raw, reply, time_remaining, request_id, identity)
        capture = self.captures.get(route.model)
        if capture is not None:
            capture.offer(raw)  # a queue append at most; never waits
        extra: dict[str, wire.Param] = {"path": outcome.path, "request_id": request_id}
        suffix = b""
        if target.model and target.model != route.model:
            suffix = wire.string_field(wire.MODEL_NAME, route.model)  # callers see the name they asked for
        overhead_us = (time.perf_counter_ns() - t0 - wait_ns) // 1000
        extra["router_overhead_us"] = overhead_us
        self.stats.record_overhead(route.model, outcome.path, overhead_us / 1e6)
        return b"".join((reply, suffix, wire.parameters_field(extra)))

    async def generate(
        self, raw: bytes, metadata: Metadata, time_remaining: float | None, peer: str
    ) -> AsyncGenerator[pb.ModelInferResponse]:
        """A request to a decoupled (generative) model: its responses as the executor sends them,
        each with the router's `path` and `request_id` and the model name the caller used.
        Admitted, limited and routed as `infer` is; an UNAVAILABLE deployment is left for the
        next one only before the first response (after it, tokens were already sent). Metered
        once at the end, with the prompt and output tokens so far (a caller that leaves early is
        charged what was generated until then, status cancelled)."""
        started_us = time.time_ns() // 1000
        request_id = ids.time_ordered_hex()
        header = wire.read_header(raw)
        route = self.route_for(header.model_name)
        identity = await self.admit(metadata, route.model, request_id, peer)
        limit = route.max_in_flight or self.settings.max_in_flight
        count = self.in_flight.get(route.model, 0)
        if count >= limit:
            self._usage(route, identity, request_id, header, Outcome(), started_us, "primary")
            raise ResourceExhausted(
                f"model {route.model!r} has {count} requests in flight (limit {limit}); retry with back-off"
            )
        self.in_flight[route.model] = count + 1
        outcome = Outcome()
        tokens = [0, 0]
        budget = self.settings.default_timeout_s if time_remaining is None else time_remaining
        deadline = time.monotonic() + budget
        try:
            choices = plan(route, self.pool.states, self.rng)
            for attempt, (target, state) in enumerate(choices):
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise DeadlineExceeded(f"deadline expired in the router before model {route.model!r} ran")
                outcome.path = state.deployment.path
                answered = False
                try:
                    body = self._body(raw, header, target)
                    async for response in self.pool.stream(target.deployment, body, timeout):
                        answered = True
                        params = response.parameters
                        tokens[:] = [
                            _int(params, oip_params.NUM_INPUT_TOKENS),
                            _int(params, oip_params.NUM_OUTPUT_TOKENS),
                        ]
                        outcome.busy_us = _int(params, oip_params.COMPUTE_US)
                        state.report_load(
                            _int(params, oip_params.IN_FLIGHT), _int(params, oip_params.QUEUE_DEPTH)
                        )
                        response.model_name = route.model
                        params["path"].string_param = outcome.path
                        params["request_id"].string_param = request_id
                        yield response
                except UpstreamError as exc:
                    if exc.status is Status.UNAVAILABLE and not answered:
                        self.pool.eject(target.deployment, f"UNAVAILABLE: {exc.details}")
                        if attempt + 1 < len(choices):
                            continue
                    raise UpstreamError(exc.status, f"{exc.details} (path {state.deployment.path})") from None
                outcome.status = "completed"
                return
        except BaseException:
            if outcome.status != "completed":
                outcome.status = "cancelled" if tokens[1] else "failed"
            raise
        finally:
            self.in_flight[route.model] -= 1
            self._usage(route, identity, request_id, header, outcome, started_us, "primary", None, tokens)

    async def is_decoupled(self, model: str) -> bool:
        """Whether a route's model sends many responses per request (ModelConfig's
        model_transaction_policy, asked once of a serving deployment and remembered)."""
        known = self._decoupled.get(model)
        if known is not None:
            return known
        route = self.route_for(model)
        target, _ = plan(route, self.pool.states, self.rng)[0]
        stub: Any = self.pool.channels[target.deployment].unary_unary(
            "/inference.GRPCInferenceService/ModelConfig",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ModelConfigResponse.FromString,
        )
        request = pb.ModelConfigRequest(name=target.model or route.model, version=target.version)
        try:
            reply = await stub(request, timeout=self.settings.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False  # asked again next time
        decoupled = bool(reply.config.model_transaction_policy.decoupled)
        self._decoupled[model] = decoupled
        return decoupled

    def _body(self, raw: bytes, header: wire.Header, target: Target) -> list[bytes]:
        """The request as sent to `target`: the caller's bytes and appended overrides."""
        parts = [raw]
        if target.model and target.model != header.model_name:
            parts.append(wire.string_field(wire.MODEL_NAME, target.model))
        if target.version and target.version != header.model_version:
            parts.append(wire.string_field(wire.MODEL_VERSION, target.version))  # the route pins it
        return parts

    async def _forward(
        self,
        route: Route,
        header: wire.Header,
        raw: bytes,
        time_remaining: float | None,
        outcome: Outcome,
    ) -> tuple[bytes, Target, int]:
        budget = self.settings.default_timeout_s if time_remaining is None else time_remaining
        deadline = time.monotonic() + budget
        choices = plan(route, self.pool.states, self.rng)
        wait_ns = 0
        for attempt, (target, state) in enumerate(choices):
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline expired in the router before model {route.model!r} ran")
            outcome.path = state.deployment.path
            t1 = time.perf_counter_ns()
            try:
                reply = await self.pool.infer(target.deployment, self._body(raw, header, target), timeout)
            except UpstreamError as exc:
                wait_ns += time.perf_counter_ns() - t1
                if exc.status is Status.UNAVAILABLE:
                    self.pool.eject(target.deployment, f"UNAVAILABLE: {exc.details}")
                    if attempt + 1 < len(choices):
                        continue  # not taken by that executor: once more elsewhere
                raise UpstreamError(exc.status, f"{exc.details} (path {state.deployment.path})") from None
            elapsed = time.perf_counter_ns() - t1
            wait_ns += elapsed
            self._account(state, reply, elapsed, outcome)
            return reply, target, wait_ns
        raise AssertionError("plan() returns at least one choice")

    def _account(self, state: DeploymentState, reply: bytes, elapsed_ns: int, outcome: Outcome) -> None:
        in_flight, queue_depth, compute, batch, prompt, output = wire.read_int_parameters(reply, _LOAD_KEYS)
        state.report_load(in_flight, queue_depth)
        outcome.tokens = (prompt, output)
        outcome.busy_us = compute // max(1, batch)  # this request's share of the batch's device time
        state.observe_service_time(elapsed_ns / 1000)
        outcome.status = "completed"

    def _usage(
        self,
        route: Route,
        identity: Identity,
        request_id: str,
        header: wire.Header,
        outcome: Outcome,
        started_us: int,
        arm: str,
        tags: dict[str, str] | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        if self.spool is None:
            return
        ended_us = max(time.time_ns() // 1000, started_us)
        # A request refused before a deployment was chosen is charged to the route's first path.
        path = outcome.path or self.pool.states[route.targets[0].deployment].deployment.path
        event = mpb.UsageEvent(
            idempotency_key=request_id if arm == "primary" else f"{request_id}:{arm}:{tags_key(tags)}",
            path=path,
            model=route.model,
            model_version=header.model_version,
            team=identity.team,
            principal=identity.principal_id,
            kind="request",
            status=outcome.status,
            met_quality=outcome.status == "completed",
            busy_us=min(outcome.busy_us, ended_us - started_us),
            started_unix_us=started_us,
            ended_unix_us=ended_us,
            arm=arm,
        )
        if tokens or any(outcome.tokens):
            event.prompt_tokens, event.output_tokens = tokens or outcome.tokens
        if tags:
            event.tags.update(tags)
        self.spool.usage(event)

    # ---- shadow -------------------------------------------------------------------------------
    def _mirror(
        self,
        route: Route,
        header: wire.Header,
        raw: bytes,
        primary: bytes,
        time_remaining: float | None,
        request_id: str,
        identity: Identity,
    ) -> None:
        assert route.shadow is not None
        for candidate in route.shadow.candidates:
            key = (route.model, candidate.label(route.model))
            stats = self.shadow_stats.setdefault(key, ShadowStats(*key))
            if self._shadow_pending >= self.settings.shadow_max_pending:
                stats.skipped += 1
                continue
            self._shadow_pending += 1
            task = asyncio.create_task(
                self._shadow_one(
                    route, header, raw, primary, time_remaining, request_id, identity, candidate, stats
                )
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _shadow_one(
        self,
        route: Route,
        header: wire.Header,
        raw: bytes,
        primary: bytes,
        time_remaining: float | None,
        request_id: str,
        identity: Identity,
        candidate: Target,
        stats: ShadowStats,
    ) -> None:
        state = self.pool.states[candidate.deployment]
        outcome = Outcome(path=state.deployment.path)
        started_us = time.time_ns() // 1000
        tags: dict[str, str] = {"shadow_of": request_id, "candidate": stats.candidate}
        try:
            budget = self.settings.default_timeout_s if time_remaining is None else max(time_remaining, 1.0)
            t1 = time.perf_counter_ns()
            reply = await self.pool.infer(candidate.deployment, self._body(raw, header, candidate), budget)
            self._account(state, reply, time.perf_counter_ns() - t1, outcome)
            d, comparer = await self._compare(
                pb.ModelInferResponse.FromString(primary), pb.ModelInferResponse.FromString(reply)
            )
            stats.comparer = comparer
            stats.add(d)
            tags.update(
                max_abs_error=repr(d.max_abs_error),
                cosine=repr(d.cosine),
                diverged=str(d.diverged).lower(),
                comparer=comparer,
            )
        except UpstreamError as exc:
            stats.failures += 1
            tags["error"] = exc.status.value
        except (SwitchyardError, ValueError, KeyError) as exc:
            stats.failures += 1
            tags["error"] = f"comparison failed: {exc}"
        finally:
            self._shadow_pending -= 1
            self._usage(route, identity, request_id, header, outcome, started_us, "shadow", tags)

    async def _compare(
        self, primary: pb.ModelInferResponse, candidate: pb.ModelInferResponse
    ) -> tuple[Divergence, str]:
        """The evaluator's judgement when one is configured and up; the local comparison otherwise."""
        if self.evaluator is not None:
            try:
                return await self.evaluator.compare(primary, candidate), "evaluator"
            except EvaluatorUnavailable as exc:
                log.warning("evaluator unreachable (%s): comparing the shadow pair locally", exc)
        d = divergence(primary, candidate, self.settings.shadow_atol, self.settings.shadow_rtol)
        return d, "local"

    def start_captures(self, root: Path) -> None:
        """A capture per route whose routes-file entry opts in; each start is audited."""
        for route in self.config.routes:
            if route.capture is None:
                continue
            capturer = Capturer(route.model, route.capture, root / route.model)
            capturer.start()
            self.captures[route.model] = capturer
            detail = json.dumps(
                {"share": route.capture.share, "max_mb": route.capture.max_mb,
                 "retention_s": route.capture.retention_s, "folder": str(capturer.folder)}
            )  # fmt: skip
            self.audit(None, "workload.capture", f"route/{route.model}", "ok", detail, "", "router")

    async def close(self) -> None:
        if self.registrar is not None:
            await self.registrar.close()
        for capturer in self.captures.values():
            await capturer.close()
        if self.auth is not None:
            await self.auth.close()
        if self.evaluator is not None:
            await self.evaluator.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
