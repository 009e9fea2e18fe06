"""inference.GRPCInferenceService on an executor: an adapter from OIP messages to `Executor`.

Convert the message, call the domain, convert back (docs/architecture.md#code-style). Statuses come from the
exception tree via switchyard.grpcio. A ModelInfer response carries the parameters named in
`switchyard.oip_params` (path, timings, load) when its request asks for them with
`switchyard_stats` (the router and the trial do); otherwise it is the bare answer, as from
Triton, and costs no more than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from services.executor.executor_runtime import Executor
from services.executor.generation import generation_oip as gen_oip
from services.executor.generation.engine import GenerationStream
from services.executor.loaded_model import LoadedModel
from services.executor.oip_metadata import MetadataRpcs
from switchyard import codec, inband_status, oip_params, telemetry
from switchyard.codec import WireTensor
from switchyard.errors import InvalidArgument, ResourceExhausted, SwitchyardError, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import grpc_service_pb2_grpc as pb_grpc
from switchyard.grpcio import ServicerContext
from switchyard.streams import StreamReplies


def _check_shared_memory(params: Any, where: str) -> None:
    if not params:
        return
    for key in oip_params.SHARED_MEMORY_KEYS:
        if key in params:
            raise Unimplemented(
                f"{where} uses shared memory ({key}); switchyard executors accept tensors only in "
                "raw_input_contents or contents"
            )


_CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


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
            continue
        if tensor.datatype == "BYTES":
            data = codec.encode_bytes(list(tensor.contents.bytes_contents))
        else:
            field = _CONTENT_FIELDS.get(tensor.datatype)
            if field is None:
                raise InvalidArgument(
                    f"input {tensor.name!r}: {tensor.datatype} must be sent in raw_input_contents"
                )
            values = getattr(tensor.contents, field)
            wire_dtype = codec.element_dtype(tensor.datatype)
            data = np.asarray(values, dtype=wire_dtype).tobytes()
        tensors.append(codec.decode(tensor.name, tensor.datatype, tensor.shape, data))
    return tensors


# BYTES inputs with more elements than this are decoded on a worker thread, not the event
# loop: splitting millions of length-prefixed elements takes seconds (64 MiB: about 8 s).
BYTES_INLINE_ELEMENTS = 4096


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


_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def _carrier(params: Any) -> dict[str, str]:
    return {k: params[k].string_param for k in (oip_params.TRACEPARENT, oip_params.TRACESTATE) if k in params}


def _deadline(request: pb.ModelInferRequest, remaining: float | None) -> float | None:
    """time.perf_counter() seconds when the request must be out of the queue: the gRPC
    deadline (`remaining` seconds) or Triton's `timeout` parameter (microseconds), whichever
    comes first."""
    now = time.perf_counter()
    deadline = now + remaining if remaining is not None else None
    if oip_params.TIMEOUT in request.parameters:
        timeout_us = request.parameters[oip_params.TIMEOUT].int64_param
        if timeout_us <= 0:
            raise InvalidArgument(f"parameter 'timeout' is {timeout_us}; send microseconds > 0")
        by_parameter = now + timeout_us / 1e6
        deadline = by_parameter if deadline is None else min(deadline, by_parameter)
    return deadline


class InferenceServicer(MetadataRpcs, pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._templates: dict[int, tuple[LoadedModel, pb.ModelInferResponse]] = {}
        self._tracing = telemetry.enabled()  # set up before the server starts, as the CLI does

    def _template(self, model: LoadedModel) -> pb.ModelInferResponse:
        """The parts of a response fixed for a loaded model, built once per load."""
        cached = self._templates.get(id(model))
        if cached is not None and cached[0] is model:
            return cached[1]
        template = pb.ModelInferResponse(model_name=model.spec.name, model_version=model.spec.version)
        params = template.parameters
        params[oip_params.BACKEND].string_param = model.backend.name
        params[oip_params.MODE].string_param = model.options.mode
        params[oip_params.PRECISION].string_param = model.options.precision
        params[oip_params.EXECUTOR].string_param = self.executor.executor_id
        self._templates = {k: v for k, v in self._templates.items() if v[0].state == "READY"}
        self._templates[id(model)] = (model, template)
        return template

    @staticmethod
    def _has_bytes(request: pb.ModelInferRequest) -> bool:
        return any(tensor.datatype == "BYTES" for tensor in request.inputs)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request answered in order; an error goes into error_message and the stream goes on.
        A generation (a causal LM's request) is decoupled: it runs beside the stream's other
        requests, and its responses are built here as this writer comes to them, each with the
        tokens that came since the last (`generation_oip.StreamedResponses`)."""
        stream: StreamReplies[pb.ModelStreamInferResponse | gen_oip.StreamedResponses] = StreamReplies()

        async def read() -> None:
            async for request in request_iterator:
                model = self._generative(request)
                if model is None:
                    stream.put(await self.answer(request, context.time_remaining()))
                    continue
                # a caller that leaves cancels it: the generation's slot is freed
                stream.start(self._stream_generation(model, request, stream.out, context))

        async with contextlib.aclosing(stream.replies(read)) as replies:  # closed as the caller leaves
            async for reply in replies:
                if not isinstance(reply, gen_oip.StreamedResponses):
                    yield reply
                elif (message := reply.take()) is not None:
                    yield message

    def _generative(self, request: pb.ModelInferRequest) -> LoadedModel | None:
        """The causal LM a stream request is for, unless the router asked for one answer."""
        try:
            model = self.executor.find(request.model_name, request.model_version)
        except SwitchyardError:
            return None  # answered (with the error) by the one-answer path
        if model.engine is None or gen_oip.UNARY in request.parameters:
            return None
        return model

    async def _stream_generation(
        self,
        model: LoadedModel,
        request: pb.ModelInferRequest,
        out: asyncio.Queue[Any],
        context: ServicerContext,
    ) -> None:
        """A generation on a stream: streamed, its events go to the stream's writer as they come
        (this task only waits for the end); else its one response."""
        try:
            async with self._generation(model, request, context.time_remaining(), True) as (responder, gen):
                if not responder.call.stream:
                    whole = await gen_oip.whole_response(
                        responder, gen, True, model.compilations_after_warmup
                    )
                    out.put_nowait(pb.ModelStreamInferResponse(infer_response=whole))
                    return
                streamed = gen_oip.StreamedResponses(responder, gen, model.compilations_after_warmup)
                streamed.attach(out)
                await streamed.done
        except Exception as exc:  # one bad request must not end the stream the others share
            message = inband_status.encode_error(exc, _STREAM_METHOD)
            out.put_nowait(inband_status.error_response(message, request.id, final=True))

    @contextlib.asynccontextmanager
    async def _generation(
        self, model: LoadedModel, request: pb.ModelInferRequest, time_remaining: float | None, decoupled: bool
    ) -> AsyncIterator[tuple[gen_oip.Responder, GenerationStream]]:
        """A generation started, with the responder of its responses; counted in flight, and
        cancelled on leaving (its slot freed) unless it finished."""
        call = gen_oip.parse_call(model, decode_inputs(request), [o.name for o in request.outputs])
        if not decoupled:
            gen_oip.check_unary(call)
        deadline = _deadline(request, time_remaining)
        stream = self.executor.generate(
            model, call.prompt, call.params, call.prompt_text is not None, deadline
        )
        template = pb.ModelInferResponse()
        template.CopyFrom(self._template(model))
        load = self.executor.load()
        template.parameters[
            oip_params.COMPILATIONS_AFTER_WARMUP
        ].int64_param = model.compilations_after_warmup()
        template.parameters[oip_params.IN_FLIGHT].int64_param = load.in_flight
        template.parameters[oip_params.QUEUE_DEPTH].int64_param = load.queue_depth
        assert model.engine is not None  # parse_call checked it
        responder = gen_oip.Responder(template, request.id, call, model.engine.tokenizer)
        self.executor.in_flight += 1
        try:
            yield responder, stream
        finally:
            stream.cancel()
            self.executor.in_flight -= 1

    async def answer(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> pb.ModelStreamInferResponse:
        """One request of a stream or of a frame connection (switchyard.frames): an error goes
        into error_message as "STATUS: why". With tracing on, each sampled request is its own span,
        parented on the `traceparent` request parameter (the router sends it)."""
        span = (
            telemetry.leaf_span(_INFER_METHOD, _carrier(request.parameters))
            if self._tracing
            else contextlib.nullcontext()
        )
        try:
            with span:
                response = await self.infer(request, time_remaining)
        except Exception as exc:  # one bad request must not end the stream the others share
            return inband_status.error_response(inband_status.encode_error(exc, _STREAM_METHOD))
        return pb.ModelStreamInferResponse(infer_response=response)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: ServicerContext
    ) -> pb.ModelInferResponse:
        if not self._tracing:
            return await self.infer(request, context.time_remaining())
        carrier = telemetry.metadata_carrier(context.invocation_metadata())
        with telemetry.leaf_span(_INFER_METHOD, carrier):
            return await self.infer(request, context.time_remaining())

    async def infer(
        self, request: pb.ModelInferRequest, time_remaining: float | None
    ) -> pb.ModelInferResponse:
        started = time.perf_counter_ns()
        generative = self.executor.find(request.model_name, request.model_version)
        if generative.engine is not None:  # a causal LM: the whole completion in one response
            async with self._generation(generative, request, time_remaining, False) as (responder, gen):
                return await gen_oip.whole_response(
                    responder, gen, False, generative.compilations_after_warmup
                )
        elements = bytes_elements(request) if self._has_bytes(request) else 0
        if elements > self.executor.config.max_bytes_elements:
            raise ResourceExhausted(
                f"the request has {elements} BYTES elements; this executor takes at most "
                f"{self.executor.config.max_bytes_elements} per request: split it"
            )
        if elements > BYTES_INLINE_ELEMENTS:
            inputs = await asyncio.to_thread(decode_inputs, request)
        else:
            inputs = decode_inputs(request)
        deadline = _deadline(request, time_remaining)
        wanted = [o.name for o in request.outputs]
        if wanted:
            declared = [
                s.name for s in self.executor.find(request.model_name, request.model_version).spec.outputs
            ]
            unknown = sorted(set(wanted) - set(declared))
            if unknown:
                raise InvalidArgument(f"unknown output(s) {unknown}; {request.model_name} has {declared}")
        model, result = await self.executor.infer(request.model_name, request.model_version, inputs, deadline)
        stats = oip_params.STATS in request.parameters and request.parameters[oip_params.STATS].bool_param
        if stats:
            response = pb.ModelInferResponse()
            response.CopyFrom(self._template(model))  # name, version and the fixed parameters
            response.id = request.id
        else:
            response = pb.ModelInferResponse(
                model_name=model.spec.name, model_version=model.spec.version, id=request.id
            )
        for spec, array in zip(model.spec.outputs, result.outputs, strict=True):
            if wanted and spec.name not in wanted:
                continue
            response.outputs.add(name=spec.name, datatype=model.wire_datatype(spec), shape=array.shape)
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
        if model.batcher is not None:  # ModelStatistics and the metrics read these
            counters = model.batcher.counters
            counters.success += 1
            counters.success_ns += time.perf_counter_ns() - started
        return response
