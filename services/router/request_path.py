"""The router's request path: a request through its stages, in order (docs/architecture.md).

    admission (key, role, principal limits)  ->  route table (which route)  ->  route in-flight
    bound  ->  policy (which deployments, in order)  ->  forwarder (send, retry, fail over)
    ->  usage meter (one event, metrics)  ->  shadow mirror, workload capture (after the
    answer, never in its way)  ->  the answer

`RequestPath.serve_tensor` takes the serialized ModelInferRequest and returns the serialized
response: it reads the request header without decoding tensors, and appends the router's own
response parameters (`path`, `router_overhead_us`, `request_id`) to the executor's bytes.
`generate` streams a decoupled (generative) model's responses through the same stages. Each
stage is its own module and knows nothing of the others; this one only puts them in order.
The servicers (`oip_servicer`, `admin_servicer`, `openai_api`) convert messages and call these stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import Message

from services.router import ids, wire, wire_write
from services.router.admission import Admission, Metadata
from services.router.auth import Identity
from services.router.capture import Capturer
from services.router.executor_pool import ExecutorPool
from services.router.executor_transport import Reply
from services.router.forwarder import Forwarded, Forwarder
from services.router.policies import Choice, DeploymentState, plan
from services.router.request_records import Charge, Outcome, now_us
from services.router.route_table import RouteTable
from services.router.router_config import Route, Settings
from services.router.router_metrics import RouterStats
from services.router.shadow_mirror import ShadowMirror
from services.router.spool import Spool
from services.router.usage_meter import UsageMeter
from switchyard.errors import NotFound, ResourceExhausted, Unavailable
from switchyard.gen.inference import grpc_service_pb2 as pb


@dataclass
class RequestPath:
    settings: Settings
    pool: ExecutorPool
    admission: Admission
    table: RouteTable
    forwarder: Forwarder
    meter: UsageMeter
    mirror: ShadowMirror
    captures: dict[str, Capturer] = field(default_factory=dict)  # route -> its workload capture
    in_flight: dict[str, int] = field(default_factory=dict)  # route model -> requests in the router
    rng: random.Random = field(default_factory=random.Random)  # the policies' random choices

    @property
    def routes(self) -> dict[str, Route]:
        return self.table.routes

    @property
    def spool(self) -> Spool | None:
        return self.meter.spool

    @property
    def stats(self) -> RouterStats:
        return self.meter.stats

    @property
    def states(self) -> Mapping[str, DeploymentState]:
        return self.pool.states

    async def _admit(self, raw: bytes, metadata: Metadata, peer: str) -> Charge:
        started_us = now_us()
        self._check_spool()
        request_id = ids.time_ordered_hex()
        header = wire.read_header(raw)
        route, identity = await self._route_of(header.model_name, metadata, request_id, peer)
        return Charge(route, identity, request_id, header, started_us)

    async def _route_of(
        self, model: str, metadata: Metadata, request_id: str, peer: str
    ) -> tuple[Route, Identity]:
        """The caller's identity first, then the route: a caller without a valid key learns no
        route names, and one with a key sees only the routes its roles cover."""
        identity = await self.admission.identify(metadata, f"model:{model}", request_id, peer)
        route = self.table.routes.get(model)
        if route is None:
            visible = self.admission.visible_models(identity, sorted(self.table.routes))
            raise NotFound(f"unknown model {model!r}; this key may use {visible}")
        self.admission.authorize(identity, route.model, request_id, peer)
        return route, identity

    def _plan(self, route: Route) -> list[Choice]:
        """The deployments to try, in order: the route's policy over their health and load."""
        return plan(route, self.pool.states, self.rng)

    def _check_spool(self) -> None:
        """A spool whose disk has no room refuses new metered requests before anything is done
        for them: what the router cannot make durable it must neither answer nor bill."""
        spool = self.meter.spool
        if spool is not None and spool.refusal:
            spool.stats.refused_requests += 1
            raise ResourceExhausted(spool.refusal)

    @contextlib.contextmanager
    def _route_slot(self, charge: Charge) -> Iterator[None]:
        """One of the route's in-flight places; over its bound the request is refused (and
        metered as failed: it reached the router's limit, not a principal's)."""
        route = charge.route
        limit = route.max_in_flight or self.settings.max_in_flight
        count = self.in_flight.get(route.model, 0)
        if count >= limit:
            self.meter.record(charge, Outcome())
            raise ResourceExhausted(
                f"model {route.model!r} has {count} requests in flight (limit {limit}); retry with back-off"
            )
        self.in_flight[route.model] = count + 1
        try:
            yield
        finally:
            self.in_flight[route.model] -= 1

    async def serve_tensor(
        self, raw: bytes, metadata: Metadata, time_remaining: float | None, peer: str
    ) -> bytes:
        t0 = time.perf_counter_ns()
        charge = await self._admit(raw, metadata, peer)
        # over the principal's limit: refused here, counted, no ledger line (admission.py)
        with self.admission.principal_slot(charge.identity):
            outcome = Outcome()
            try:
                sent = await self._forward_tensor(charge, raw, time_remaining, outcome)
                self.mirror.offer(charge, raw, sent.reply, time_remaining)
                capture = self.captures.get(charge.route.model)
                if capture is not None:
                    capture.offer(raw)  # a queue append at most; never waits
                await self._durable()  # the usage is on disk before the answer leaves
            except BaseException:  # no answer: its time, and no overhead, for the metrics
                self.meter.observe(charge, outcome, (time.perf_counter_ns() - t0) / 1e9)
                raise
            return self._answer(charge, outcome, sent, t0)

    async def _forward_tensor(
        self, charge: Charge, raw: bytes, time_remaining: float | None, outcome: Outcome
    ) -> Forwarded:
        """The request sent by its route's plan within the route's in-flight bound, and its
        usage charged once, whatever became of it."""
        with self._route_slot(charge):
            try:
                return await self.forwarder.forward_tensor(
                    charge, self._plan(charge.route), raw, time_remaining, outcome
                )
            except asyncio.CancelledError:
                outcome.status = "cancelled"
                raise
            finally:
                self.meter.record(charge, outcome)

    async def _durable(self) -> None:
        try:
            await self.meter.durable()
        except OSError as exc:  # the usage stays in memory; the spool delivers it
            raise Unavailable(f"the router cannot make usage durable ({exc.strerror or exc}); retry") from exc

    def _answer(self, charge: Charge, outcome: Outcome, sent: Forwarded, t0: int) -> bytes:
        """The executor's bytes with the router's parameters appended."""
        route = charge.route
        renamed = sent.target.model and sent.target.model != route.model
        elapsed_ns = time.perf_counter_ns() - t0
        overhead_us = (elapsed_ns - sent.wait_ns) // 1000  # the router's own time
        self.meter.observe(charge, outcome, elapsed_ns / 1e9, overhead_us / 1e6)
        # callers see the model name they asked for
        return wire_write.router_answer(
            sent.reply, outcome.path, charge.request_id, overhead_us, route.model if renamed else ""
        )

    async def generate(
        self, raw: bytes, metadata: Metadata, time_remaining: float | None, peer: str
    ) -> AsyncGenerator[pb.ModelInferResponse]:
        """A request to a decoupled (generative) model: its responses as the executor sends them,
        each with the router's `path` and `request_id` and the model name the caller used.
        Admitted, limited and routed as `serve_tensor` is. Metered once at the end, with the prompt and
        output tokens so far (a caller that leaves early is charged what was generated until
        then, status cancelled)."""
        charge = await self._admit(raw, metadata, peer)
        # over the principal's limit: refused here, as `serve_tensor` is (each of `n` choices is a call)
        with self.admission.principal_slot(charge.identity):
            outcome = Outcome()
            kept: list[pb.ModelInferResponse] | None = [] if charge.route.shadow is not None else None
            with self._route_slot(charge):
                try:
                    responses = self.forwarder.stream(
                        charge, self._plan(charge.route), raw, time_remaining, outcome
                    )
                    async with contextlib.aclosing(responses):  # a caller that leaves ends the call now
                        async for response in responses:
                            response.model_name = charge.route.model
                            response.parameters["path"].string_param = outcome.path
                            response.parameters["request_id"].string_param = charge.request_id
                            if kept is not None:
                                kept.append(response)  # the whole generation, for the shadow mirror
                            yield response
                except BaseException:
                    if outcome.status != "completed":
                        outcome.status = "cancelled" if outcome.output_tokens else "failed"
                    raise
                finally:
                    self.meter.record(charge, outcome)
            if kept is not None and outcome.status == "completed":
                self.mirror.offer_generation(charge, raw, kept, time_remaining)
            capture = self.captures.get(charge.route.model)
            if capture is not None and outcome.status == "completed":
                capture.offer(raw, outcome.output_tokens)  # prompt, sampling parameters; never waits

    async def ask(
        self,
        model: str,
        metadata: Metadata,
        peer: str,
        time_remaining: float | None,
        call: tuple[str, Message, type[Reply]],
    ) -> Reply:
        """A small OIP RPC (`call`: method, request, reply type) for the route of `model`,
        admitted as inference is, answered by a serving deployment of the route."""
        route, _ = await self._route_of(model, metadata, ids.time_ordered_hex(), peer)
        method, request, reply_type = call
        timeout = time_remaining or self.settings.default_timeout_s
        return await self.forwarder.ask(self._plan(route)[0], method, request, reply_type, timeout)

    async def is_decoupled(self, model: str) -> bool:
        route = self.table.route_for(model)
        known = self.forwarder.known_decoupled(route)
        if known is not None:
            return known
        return await self.forwarder.ask_decoupled(route, self._plan(route)[0])

    async def close(self) -> None:
        await self.table.close()
        for capturer in self.captures.values():
            await capturer.close()
        await self.admission.close()
        await self.mirror.close()
