"""A causal LM's requests on the executor's data plane: the whole completion in one response
(ModelInfer, or `stream` false), or decoupled on a stream, a response per engine output.

The data plane (`data_plane.py`) sends a request here when its model has a generation engine;
the messages are built by `generation/generation_oip.py` from the engine's events. A generation
is counted in flight while it runs, and cancelled (its slot freed) when its caller leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from services import inband_status
from services.executor.executor_runtime import Executor
from services.executor.generation import generation_oip as gen_oip
from services.executor.generation.engine_client import GenerationStream
from services.executor.loaded_model import LoadedModel
from switchyard import oip_params
from switchyard.codec import WireTensor
from switchyard.errors import SwitchyardError
from switchyard.gen.inference import grpc_service_pb2 as pb

_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


# how the data plane reads a request: its deadline, then its inputs (`DataPlane.read`)
ReadRequest = Callable[[pb.ModelInferRequest, float | None], Awaitable[tuple[float | None, list[WireTensor]]]]


class GenerationCalls:
    def __init__(
        self,
        executor: Executor,
        template: Callable[[LoadedModel], pb.ModelInferResponse],
        read: ReadRequest,
    ) -> None:
        self.executor = executor
        self._template = template  # a loaded model's fixed response parts (the data plane's)
        self._read = read  # the data plane's reading of a request

    def decoupled(self, request: pb.ModelInferRequest) -> LoadedModel | None:
        """The causal LM a stream request is for, unless the router asked for one answer."""
        try:
            model = self.executor.find(request.model_name, request.model_version)
        except SwitchyardError:
            return None  # answered (with the error) by the one-answer path
        if model.engine is None or gen_oip.UNARY in request.parameters:
            return None
        return model

    async def unary(
        self,
        model: LoadedModel,
        request: pb.ModelInferRequest,
        inputs: list[WireTensor],
        deadline: float | None,
        started_ns: int,
    ) -> pb.ModelInferResponse:
        """The whole completion in one response (ModelInfer; `stream` true is UNIMPLEMENTED),
        from the request's `inputs` and `deadline` as the data plane read them. `started_ns`
        goes unused: a generation's statistics are its engine's."""
        async with self._generation(model, request, inputs, deadline, False) as (responder, gen):
            return await gen_oip.whole_response(responder, gen, False, model.compilations_after_warmup)

    async def stream(
        self,
        model: LoadedModel,
        request: pb.ModelInferRequest,
        out: asyncio.Queue[Any],
        time_remaining: float | None,
    ) -> None:
        """A generation on a stream: streamed, its events go to the stream's writer as they come
        (this task only waits for the end); else its one response. An error is answered
        in-band, final, with the request's id."""
        try:
            # read as the data plane reads a unary request (the model was found to tell a
            # generation from a tensor request, so a reload during a long decode is not seen)
            deadline, inputs = await self._read(request, time_remaining)
            async with self._generation(model, request, inputs, deadline, True) as (responder, gen):
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
        self,
        model: LoadedModel,
        request: pb.ModelInferRequest,
        inputs: list[WireTensor],
        deadline: float | None,
        decoupled: bool,
    ) -> AsyncIterator[tuple[gen_oip.Responder, GenerationStream]]:
        """A generation started, with the responder of its responses; counted in flight, and
        cancelled on leaving (its slot freed) unless it finished."""
        call = gen_oip.parse_call(model, inputs, [o.name for o in request.outputs])
        if not decoupled:
            gen_oip.check_unary(call)
        executor = self.executor
        stream = executor.generate(model, call.prompt, call.params, call.prompt_text is not None, deadline)
        template = pb.ModelInferResponse()
        template.CopyFrom(self._template(model))
        load = executor.load()
        params = template.parameters
        params[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param = model.compilations_after_warmup()
        params[oip_params.IN_FLIGHT].int64_param = load.in_flight
        params[oip_params.QUEUE_DEPTH].int64_param = load.queue_depth
        assert model.engine is not None  # parse_call checked it
        responder = gen_oip.Responder(template, request.id, call, model.engine.tokenizer)
        executor.in_flight += 1
        try:
            yield responder, stream
        finally:
            stream.cancel()
            executor.in_flight -= 1
