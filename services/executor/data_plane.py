"""The executor's data plane: an OIP request in, its answer out, whichever transport carried it.

gRPC ModelInfer and ModelStreamInfer (`executor_servicer.py`) and framed inference
(`frame_server.py`, services.frames) are adapters over `DataPlane`, as KServe's servicers are
over its DataPlane: each runs its own call, stream or connection and asks the data plane for
one request's answer (`infer`, or `answer` where an error must go in-band).

It reads the request (`read`): its deadline, the transport's or Triton's `timeout` parameter,
whichever comes first (`deadline_of`), then its inputs, raw contents (one per input, in order)
or typed `contents` (both decoded by switchyard.codec), never both; shared memory is
UNIMPLEMENTED, and BYTES inputs are bounded before any decoding, many of them decoded on a
worker thread (`read_inputs`). It then finds the model once and, by its kind, hands the
request to one of two strategies (`_respond`, the one place the paths part): a tensor model's
to `TensorCalls`, a causal LM's to its generation engine (`generation_calls.GenerationCalls`).
`TensorCalls` checks the inputs against the declaration (`model_arrays`: names, datatypes,
ranks, dims, one batch size, in full once per signature), hands the arrays to the model's
batcher (or, on a quiet executor, computes a lone request at once), selects the outputs asked
for, adds the parameters named in `switchyard.oip_params` (path, timings, load) when the
request asks for them with `switchyard_stats` (the router and the trial do; otherwise the
answer is bare, as Triton's, and costs no more), and counts the request for ModelStatistics
and the metrics. Errors are `switchyard.errors`: raised to the
gRPC edge on ModelInfer, written in-band as "STATUS: why" on streams and frames (`answer`),
where one bad request must not end the others. No grpc here. What a client asks about the
server and its models is answered beside it, from the same executor
(`oip_metadata.OipMetadata`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services import inband_status
from services.executor.batching import BatchResult
from services.executor.executor_runtime import Draining, Executor
from services.executor.generation_calls import GenerationCalls
from services.executor.loaded_model import LoadedModel
from switchyard import codec, oip_params, telemetry
from switchyard.codec import WireTensor
from switchyard.errors import InvalidArgument, ResourceExhausted, Unavailable, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb

_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

# The inline fast path is for a quiet executor, and "quiet" is read from the event loop's own
# thread: since the last request finished, it sat idle (waiting on the network, not running)
# for at least this long. Requests waiting inside gRPC cannot be counted from here, but they
# keep the loop busy: at 16 clients it accepts, decodes and answers calls back to back and
# never idles, so every request goes through the batcher and the device thread, where
# batches form while the loop takes in the next ones. A lone client's next request leaves the
# loop idle for the client's whole turn (its decode, its next request, the loopback), well
# over this. (A gap in wall time alone cannot tell the two apart: under load gRPC's own work
# between two handlers takes as long as a lone client's round trip.)
LOOP_IDLE_S = 100e-6
INLINE_LOOK_TURNS = 3

# BYTES inputs with more elements than this are decoded on a worker thread, not the event
# loop: splitting millions of length-prefixed elements takes seconds (64 MiB: about 8 s).
BYTES_INLINE_ELEMENTS = 4096

Metadata = Callable[[], Any]  # the caller's gRPC metadata, read only where tracing is on
# a signature (names, datatypes, shapes) -> the position of each declared input in the request
Signatures = dict[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[int, ...]]


class _ModelPlan:
    """What the data plane keeps of one loaded model, built on its first request: the
    response's fixed parts, its outputs' names and wire datatypes, the checked signatures."""

    __slots__ = ("model", "outputs", "signatures", "template")

    def __init__(self, model: LoadedModel, executor_id: str) -> None:
        self.model = model
        self.outputs = model.wire_outputs
        self.signatures: Signatures = {}
        template = pb.ModelInferResponse(model_name=model.spec.name, model_version=model.spec.version)
        params = template.parameters
        params[oip_params.BACKEND].string_param = model.backend.name
        params[oip_params.MODE].string_param = model.options.mode
        params[oip_params.PRECISION].string_param = model.options.precision
        params[oip_params.EXECUTOR].string_param = executor_id
        self.template = template


class DataPlane:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._tracing = telemetry.enabled()  # set up before the server starts, as the CLI does
        self.tensors = TensorCalls(executor)
        self.generations = GenerationCalls(executor, self.tensors.template, self.read)

    # ---- inference -----------------------------------------------------------------------
    async def infer(
        self, request: pb.ModelInferRequest, time_remaining: float | None, metadata: Metadata | None = None
    ) -> pb.ModelInferResponse:
        """One request, one response; errors raise. With tracing on, each sampled request is
        its own span, parented on the caller's gRPC `metadata()` or, without it, on the
        request's `traceparent` parameter (the router sends it on streams and frames)."""
        if not self._tracing:
            return await self._respond(request, time_remaining)
        carrier = (
            telemetry.metadata_carrier(metadata())
            if metadata is not None
            else _trace_carrier(request.parameters)
        )
        with telemetry.leaf_span(_INFER_METHOD, carrier):
            return await self._respond(request, time_remaining)

    async def answer(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> pb.ModelStreamInferResponse:
        """One request of a stream or of a frame connection: an error goes into error_message
        as "STATUS: why", and the stream or connection goes on."""
        try:
            response = await self.infer(request, time_remaining)
        except Exception as exc:  # one bad request must not end the stream the others share
            return inband_status.error_response(inband_status.encode_error(exc, _STREAM_METHOD))
        return pb.ModelStreamInferResponse(infer_response=response)

    async def _respond(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> pb.ModelInferResponse:
        """The request read (its deadline from its arrival, then its inputs), the model found
        once it is (a reload may land while a large BYTES request decodes on a worker thread),
        and then the one place where the tensor and the generation paths part, by its kind."""
        started = time.perf_counter_ns()
        deadline, inputs = await self.read(request, time_remaining)
        model = self.executor.find(request.model_name, request.model_version)
        calls: TensorCalls | GenerationCalls = self.tensors if model.engine is None else self.generations
        return await calls.unary(model, request, inputs, deadline, started)

    async def read(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> tuple[float | None, list[WireTensor]]:
        """What a request brings, in the order it is read: its deadline, counted from now (its
        arrival, not after a long decode), then its inputs (`read_inputs`). A generation on a
        stream is read with this too (`GenerationCalls.stream`)."""
        deadline = deadline_of(request.parameters, time_remaining)
        return deadline, await read_inputs(request, self.executor.config.max_bytes_elements)


class TensorCalls:
    """A tensor model's requests, read by the data plane: the plan, the arrays handed to the
    model's batcher, the answer; in that order, each once."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._plans: dict[int, _ModelPlan] = {}
        self._last_done = 0.0  # time.perf_counter() when the last tensor request was handed back
        self._last_done_cpu = 0.0  # time.thread_time() of the loop's thread then

    async def unary(
        self,
        model: LoadedModel,
        request: pb.ModelInferRequest,
        inputs: list[WireTensor],
        deadline: float | None,
        started_ns: int,
    ) -> pb.ModelInferResponse:
        """One request's answer; `started_ns` (time.perf_counter_ns()) when it was taken."""
        executor = self.executor
        plan = self._plan(model)
        wanted = [o.name for o in request.outputs]
        if wanted:
            declared = [name for name, _ in plan.outputs]
            unknown = sorted(set(wanted) - set(declared))
            if unknown:
                raise InvalidArgument(f"unknown output(s) {unknown}; {request.model_name} has {declared}")
        if executor.draining:
            raise Draining("executor is draining; retry on another executor")
        if model.state != "READY" or model.batcher is None:
            raise Unavailable(f"model {model.spec.name!r} is {model.state}; retry when it is READY")
        result = await self._hand_off(model, plan, inputs, deadline)
        response = self._response(plan, request, wanted, result)
        counters = model.batcher.counters  # ModelStatistics and the metrics read these
        counters.success += 1
        counters.success_ns += time.perf_counter_ns() - started_ns
        return response

    async def _hand_off(
        self, model: LoadedModel, plan: _ModelPlan, inputs: list[WireTensor], deadline: float | None
    ) -> BatchResult:
        """The inputs, checked, as the model's arrays to its batcher; or, alone on a quiet
        executor and short, computed right here (a queue and thread hand-offs would cost more)."""
        arrays, rows = model_arrays(model, plan.signatures, inputs)
        executor = self.executor
        batcher = model.batcher
        assert batcher is not None  # READY, checked by the caller
        # wall time since the last request finished, less what the loop's thread ran meanwhile
        idle = (time.perf_counter() - self._last_done) - (time.thread_time() - self._last_done_cpu)
        executor.in_flight += 1
        try:
            if (
                idle > LOOP_IDLE_S
                and executor.in_flight == 1
                and batcher.idle
                and executor.device_idle
                and model.expected_compute_s(arrays, rows) <= executor.inline_limit_s
            ):
                # Requests that reached gRPC while the loop was busy show up within a few loop
                # turns; counted in flight, this one makes them queue rather than go inline.
                for _ in range(INLINE_LOOK_TURNS):
                    await asyncio.sleep(0)
                if executor.in_flight == 1 and batcher.idle and executor.device_idle:
                    return batcher.run_now(arrays, rows, model.compute)
            return await batcher.submit(arrays, rows, deadline)
        finally:
            executor.in_flight -= 1
            self._last_done = time.perf_counter()
            self._last_done_cpu = time.thread_time()

    def _response(
        self, plan: _ModelPlan, request: pb.ModelInferRequest, wanted: Sequence[str], result: BatchResult
    ) -> pb.ModelInferResponse:
        """The outputs asked for (all where none are named), with the statistics parameters
        where the request asks for them."""
        model = plan.model
        stats = oip_params.STATS in request.parameters and request.parameters[oip_params.STATS].bool_param
        if stats:
            response = pb.ModelInferResponse()
            response.CopyFrom(plan.template)  # name, version and the fixed parameters
            response.id = request.id
        else:
            response = pb.ModelInferResponse(
                model_name=model.spec.name, model_version=model.spec.version, id=request.id
            )
        for (name, datatype), array in zip(plan.outputs, result.outputs, strict=True):
            if wanted and name not in wanted:
                continue
            response.outputs.add(name=name, datatype=datatype, shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        if stats:
            load = self.executor.load()
            params = response.parameters
            params[oip_params.QUEUE_US].int64_param = result.queue_us
            params[oip_params.COMPUTE_US].int64_param = result.compute_us
            params[oip_params.BATCH_SIZE].int64_param = result.batch_size
            params[oip_params.PADDED_BATCH_SIZE].int64_param = result.padded_batch_size
            params[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param = model.compilations_after_warmup()
            params[oip_params.IN_FLIGHT].int64_param = load.in_flight
            params[oip_params.QUEUE_DEPTH].int64_param = load.queue_depth
        return response

    def _plan(self, model: LoadedModel) -> _ModelPlan:
        plan = self._plans.get(id(model))
        if plan is not None and plan.model is model:
            return plan
        plan = _ModelPlan(model, self.executor.executor_id)
        self._plans = {k: v for k, v in self._plans.items() if v.model.state == "READY"}
        self._plans[id(model)] = plan
        return plan

    def template(self, model: LoadedModel) -> pb.ModelInferResponse:
        """The parts of a response fixed for a loaded model, built once per load."""
        return self._plan(model).template


# ---- a request read off the wire and bounded: its deadline, its inputs -------------------
def deadline_of(parameters: Any, remaining: float | None) -> float | None:
    """time.perf_counter() seconds when a request must be out of the queue: the transport's
    deadline (`remaining` seconds) or the request's `timeout` parameter (microseconds, in
    `parameters`), whichever comes first; INVALID_ARGUMENT for a `timeout` not above 0."""
    now = time.perf_counter()
    deadline = now + remaining if remaining is not None else None
    if oip_params.TIMEOUT in parameters:
        timeout_us = parameters[oip_params.TIMEOUT].int64_param
        if timeout_us <= 0:
            raise InvalidArgument(f"parameter 'timeout' is {timeout_us}; send microseconds > 0")
        by_parameter = now + timeout_us / 1e6
        deadline = by_parameter if deadline is None else min(deadline, by_parameter)
    return deadline


def _check_shared_memory(params: Any, where: str) -> None:
    if not params:
        return
    for key in oip_params.SHARED_MEMORY_KEYS:
        if key in params:
            raise Unimplemented(
                f"{where} uses shared memory ({key}); switchyard executors accept tensors only in "
                "raw_input_contents or contents"
            )


def decode_inputs(request: pb.ModelInferRequest) -> list[WireTensor]:
    """Raw contents (one per input, in order) or typed `contents`, never both."""
    _check_shared_memory(request.parameters, "the request")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; send one per input, in order"
        )
    tensors = []
    for i, tensor in enumerate(request.inputs):
        _check_shared_memory(tensor.parameters, f"input {tensor.name!r}")
        if raw:
            tensors.append(codec.decode(tensor.name, tensor.datatype, tensor.shape, raw[i]))
        else:
            tensors.append(codec.decode_contents(tensor.name, tensor.datatype, tensor.shape, tensor.contents))
    return tensors


async def read_inputs(request: pb.ModelInferRequest, max_bytes_elements: int) -> list[WireTensor]:
    """A request's inputs, decoded: BYTES inputs are bounded before any decoding
    (RESOURCE_EXHAUSTED over `max_bytes_elements`), and many of them decode on a worker thread,
    not the event loop."""
    elements = bytes_elements(request)  # 0 without BYTES inputs
    if elements > max_bytes_elements:
        raise ResourceExhausted(
            f"the request has {elements} BYTES elements; this executor takes at most "
            f"{max_bytes_elements} per request: split it"
        )
    if elements > BYTES_INLINE_ELEMENTS:
        return await asyncio.to_thread(decode_inputs, request)
    return decode_inputs(request)


def bytes_elements(request: pb.ModelInferRequest) -> int:
    """How many BYTES elements the request's shapes declare (checked before any decoding)."""
    total = 0
    for tensor in request.inputs:
        if tensor.datatype == "BYTES":
            count = 1
            for dim in tensor.shape:
                count *= max(int(dim), 0)
            total += max(count, len(tensor.contents.bytes_contents))
    return total


# ---- a request's inputs checked against its model's declaration ---------------------------
def model_arrays(
    model: LoadedModel, signatures: Signatures, inputs: list[WireTensor]
) -> tuple[list[np.ndarray], int]:
    """The arrays of `inputs` in the model's declared order, and their rows; a signature that
    passed once is remembered in `signatures` (the model's own, kept in its `_ModelPlan`), so
    steady traffic pays a dict lookup."""
    signature = tuple((t.name, t.datatype, t.shape) for t in inputs)
    order = signatures.get(signature)
    if order is not None:
        return [inputs[i].array for i in order], inputs[0].shape[0]
    arrays, rows = _check_inputs(model, inputs)
    if len(signatures) < 1024:
        position = {t.name: i for i, t in enumerate(inputs)}
        signatures[signature] = tuple(position[s.name] for s in model.spec.inputs)
    return arrays, rows


def _check_inputs(model: LoadedModel, inputs: list[WireTensor]) -> tuple[list[np.ndarray], int]:
    """The full check of a request's inputs against the model's declaration (names, datatypes,
    ranks, dims, one batch size; a float input as the loaded precision's datatype or as FP32,
    which trials send to every path); the arrays in declared order and the rows."""
    by_name = {t.name: t for t in inputs}
    if len(by_name) != len(inputs):
        raise InvalidArgument("an input name appears twice; send each input once")
    declared = {s.name for s in model.spec.inputs}
    extra = sorted(set(by_name) - declared)
    if extra:
        raise InvalidArgument(f"unexpected input(s) {extra}; {model.spec.name} takes {sorted(declared)}")
    arrays: list[np.ndarray] = []
    rows = -1
    for s in model.spec.inputs:
        t = by_name.get(s.name)
        if t is None:
            raise InvalidArgument(f"missing input {s.name!r}; {model.spec.name} takes {sorted(declared)}")
        allowed = {model.wire_datatype(s), "FP32"} if s.floating else {s.datatype}
        if t.datatype not in allowed:
            raise InvalidArgument(
                f"input {s.name!r} has datatype {t.datatype}; send {' or '.join(sorted(allowed))}"
            )
        want = f"[batch, {', '.join(str(d) for d in s.dims)}]".replace(", ]", "]")
        if len(t.shape) != len(s.dims) + 1:
            raise InvalidArgument(
                f"input {s.name!r} has rank {len(t.shape)} {list(t.shape)}; expected {want}"
            )
        for axis, (got, dim) in enumerate(zip(t.shape[1:], s.dims, strict=True), start=1):
            limit = s.max_dims[axis - 1] if s.max_dims else None
            if (dim >= 0 and got != dim) or got == 0 or (limit is not None and got > limit):
                bound = f" (at most {limit})" if limit is not None and dim < 0 else ""
                raise InvalidArgument(
                    f"input {s.name!r} has shape {list(t.shape)}; expected {want}{bound}, "
                    f"dimension {axis} is wrong"
                )
        if rows not in (-1, t.shape[0]):
            raise InvalidArgument(f"inputs disagree on the batch dimension ({rows} vs {t.shape[0]})")
        rows = t.shape[0]
        arrays.append(t.array)
    if rows < 1 or rows > model.max_batch:
        raise InvalidArgument(f"batch dimension is {rows}; this model accepts 1 to {model.max_batch} rows")
    return arrays, rows


def _trace_carrier(params: Any) -> dict[str, str]:
    """The trace context a request carries in its parameters (the router sets them)."""
    return {k: params[k].string_param for k in (oip_params.TRACEPARENT, oip_params.TRACESTATE) if k in params}
