"""The forwarder: where a request goes, with what deadline, and what happens when that fails.

It is handed the plan, the deployments to try in order (`policies.plan`, which the request
path asks before it calls here), sends the caller's bytes with the overrides of each target
appended (`wire_write`: its model name and version), and gives each attempt what is left of
the caller's deadline (Triton's `timeout` on the executor's side). Retry: one more deployment
when the first answered UNAVAILABLE (the executor did not take the request: not connected,
draining, or gone), which is also ejected at once (passive health); OIP inference has no side
effects, and only the attempt that answered is charged. A generation fails over the same way,
but only before its first response (after it, tokens were already sent). Any other status
goes back to the caller as the executor answered it, naming the path. Each answer's reported
load and measured service time feed the next plan. All of it goes through an
`ExecutorTransport`; this module has no grpc.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import Message

from services.router import wire, wire_write
from services.router.executor_transport import ExecutorTransport, Reply
from services.router.policies import Choice, DeploymentState
from services.router.request_records import Charge, Outcome
from services.router.router_config import Route, Settings, Target
from switchyard import oip_params
from switchyard.errors import DeadlineExceeded, Status, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb

# Response parameters every executor sets: load for routing, device time (and a generation's
# tokens, answered unary) for usage.
_LOAD_KEYS = (
    oip_params.IN_FLIGHT, oip_params.QUEUE_DEPTH, oip_params.COMPUTE_US, oip_params.BATCH_SIZE,
    oip_params.NUM_INPUT_TOKENS, oip_params.NUM_OUTPUT_TOKENS,  # generation only; 0 otherwise
)  # fmt: skip


class ExecutorFleet(ExecutorTransport, Protocol):
    """The transport, with what the router knows of each deployment's health and load."""

    @property
    def states(self) -> Mapping[str, DeploymentState]: ...

    def eject(self, deployment: str, reason: str) -> None: ...


@dataclass(frozen=True)
class Forwarded:
    """An executor's answer: its bytes, the target that gave it, and the time spent waiting."""

    reply: bytes
    target: Target
    wait_ns: int


def _int(params: Any, key: str) -> int:
    return int(params[key].int64_param) if key in params else 0


def body(raw: bytes, header: wire.Header, target: Target) -> list[bytes]:
    """The request as sent to `target`: the caller's bytes and appended overrides."""
    parts = [raw]
    if target.model and target.model != header.model_name:
        parts.append(wire_write.string_field(wire.MODEL_NAME, target.model))
    if target.version and target.version != header.model_version:
        parts.append(wire_write.string_field(wire.MODEL_VERSION, target.version))  # the route pins it
    return parts


def _named(exc: UpstreamError, path: str) -> UpstreamError:
    """The executor's status as the caller sees it, naming the deployment's path."""
    return UpstreamError(exc.status, f"{exc.details} (path {path})")


class Forwarder:
    def __init__(self, fleet: ExecutorFleet, settings: Settings) -> None:
        self.fleet = fleet
        self.settings = settings
        self._decoupled: dict[str, bool] = {}  # route model -> decoupled (generative)

    def serving(self) -> bool:
        """Whether any deployment is routed to (the router is ready)."""
        return any(s.admitted() for s in self.fleet.states.values())

    def _attempts(
        self, route: Route, choices: Sequence[Choice], time_remaining: float | None
    ) -> Iterator[tuple[Target, DeploymentState, float, bool]]:
        """(target, its state, the time left, whether another attempt follows) in plan order."""
        budget = self.settings.default_timeout_s if time_remaining is None else time_remaining
        deadline = time.monotonic() + budget
        for attempt, (target, state) in enumerate(choices):
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded(f"deadline expired in the router before model {route.model!r} ran")
            yield target, state, timeout, attempt + 1 < len(choices)

    def _not_taken(self, exc: UpstreamError, deployment: str) -> bool:
        """Whether the executor did not take the request (UNAVAILABLE), which ejects it."""
        if exc.status is not Status.UNAVAILABLE:
            return False
        self.fleet.eject(deployment, f"UNAVAILABLE: {exc.details}")
        return True

    async def forward_tensor(
        self,
        charge: Charge,
        choices: Sequence[Choice],
        raw: bytes,
        time_remaining: float | None,
        outcome: Outcome,
    ) -> Forwarded:
        """The answer of the first deployment of the plan (`choices`) that takes the request."""
        wait_ns = 0
        header = charge.header
        for target, state, timeout, retry in self._attempts(charge.route, choices, time_remaining):
            outcome.path = state.deployment.path
            parts = body(raw, header, target)
            t1 = time.perf_counter_ns()
            try:
                reply = await self.fleet.send_tensor(target.deployment, parts, timeout)
            except UpstreamError as exc:
                wait_ns += time.perf_counter_ns() - t1
                if self._not_taken(exc, target.deployment) and retry:
                    continue  # not taken by that executor: once more elsewhere
                raise _named(exc, outcome.path) from None
            elapsed = time.perf_counter_ns() - t1
            self._account(state, reply, elapsed, outcome)
            return Forwarded(reply, target, wait_ns + elapsed)
        raise AssertionError("plan() returns at least one choice")

    def path_of(self, target: Target) -> str:
        return self.fleet.states[target.deployment].deployment.path

    async def forward_copy(
        self, target: Target, header: wire.Header, raw: bytes, timeout_s: float, outcome: Outcome
    ) -> bytes:
        """The answer of one given target (a shadow candidate): no plan, no retry."""
        state = self.fleet.states[target.deployment]
        t1 = time.perf_counter_ns()
        reply = await self.fleet.send_tensor(target.deployment, body(raw, header, target), timeout_s)
        self._account(state, reply, time.perf_counter_ns() - t1, outcome)
        return reply

    def _account(self, state: DeploymentState, reply: bytes, elapsed_ns: int, outcome: Outcome) -> None:
        in_flight, queue_depth, compute, batch, prompt, output = wire.read_int_parameters(reply, _LOAD_KEYS)
        state.report_load(in_flight, queue_depth)
        outcome.prompt_tokens, outcome.output_tokens = prompt, output
        outcome.busy_us = compute // max(1, batch)  # this request's share of the batch's device time
        state.observe_service_time(elapsed_ns / 1000)
        outcome.status = "completed"

    async def stream(
        self,
        charge: Charge,
        choices: Sequence[Choice],
        raw: bytes,
        time_remaining: float | None,
        outcome: Outcome,
    ) -> AsyncGenerator[pb.ModelInferResponse]:
        """A decoupled (generative) request's responses as the executor sends them, from the
        first deployment of the plan (`choices`) that takes it; the tokens and device time so
        far are kept in `outcome` as they come."""
        header = charge.header
        for target, state, timeout, retry in self._attempts(charge.route, choices, time_remaining):
            outcome.path = state.deployment.path
            answered = False
            try:
                async for response in self.fleet.stream(
                    target.deployment, body(raw, header, target), timeout
                ):
                    answered = True
                    params = response.parameters
                    outcome.prompt_tokens = _int(params, oip_params.NUM_INPUT_TOKENS)
                    outcome.output_tokens = _int(params, oip_params.NUM_OUTPUT_TOKENS)
                    outcome.busy_us = _int(params, oip_params.COMPUTE_US)
                    state.report_load(
                        _int(params, oip_params.IN_FLIGHT), _int(params, oip_params.QUEUE_DEPTH)
                    )
                    yield response
            except UpstreamError as exc:
                if not answered and self._not_taken(exc, target.deployment) and retry:
                    continue  # before its first response: once more elsewhere
                raise _named(exc, outcome.path) from None
            outcome.status = "completed"
            return

    async def stream_on(
        self, target: Target, header: wire.Header, raw: bytes, timeout_s: float, outcome: Outcome
    ) -> AsyncGenerator[pb.ModelInferResponse]:
        """A decoupled request's responses from one given target (a shadow candidate): no plan,
        no retry; the tokens and device time so far kept in `outcome`."""
        state = self.fleet.states[target.deployment]
        async for response in self.fleet.stream(target.deployment, body(raw, header, target), timeout_s):
            params = response.parameters
            outcome.prompt_tokens = _int(params, oip_params.NUM_INPUT_TOKENS)
            outcome.output_tokens = _int(params, oip_params.NUM_OUTPUT_TOKENS)
            outcome.busy_us = _int(params, oip_params.COMPUTE_US)
            state.report_load(_int(params, oip_params.IN_FLIGHT), _int(params, oip_params.QUEUE_DEPTH))
            yield response
        outcome.status = "completed"

    async def ask(
        self, choice: Choice, method: str, request: Message, reply_type: type[Reply], timeout_s: float
    ) -> Reply:
        """One small OIP RPC (ModelMetadata, ModelConfig, ModelReady, ModelStatistics) to a serving
        deployment of a route (the plan's first `choice`), for the model (and version) it serves."""
        target, state = choice
        # ModelMetadata/Config/Ready/Statistics requests all name the model in `name` and `version`.
        if target.model:
            request.name = target.model  # type: ignore[attr-defined]
        if target.version:
            request.version = target.version  # type: ignore[attr-defined]
        try:
            return await self.fleet.call(target.deployment, method, request, reply_type, timeout_s)
        except UpstreamError as exc:
            self._not_taken(exc, target.deployment)
            raise _named(exc, state.deployment.path) from None

    def known_decoupled(self, route: Route) -> bool | None:
        """Whether a route's model is decoupled, where `ask_decoupled` learnt it already."""
        return self._decoupled.get(route.model)

    async def ask_decoupled(self, route: Route, choice: Choice) -> bool:
        """Whether a route's model sends many responses per request (ModelConfig's
        model_transaction_policy, asked of a serving deployment, the plan's first `choice`,
        and remembered)."""
        target, _ = choice
        request = pb.ModelConfigRequest(name=target.model or route.model, version=target.version)
        try:
            reply = await self.fleet.call(
                target.deployment,
                "ModelConfig",
                request,
                pb.ModelConfigResponse,
                self.settings.health_timeout_s,
            )
        except UpstreamError:
            return False  # asked again next time
        decoupled = bool(reply.config.model_transaction_policy.decoupled)
        self._decoupled[route.model] = decoupled
        return decoupled
