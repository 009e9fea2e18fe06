"""What an OIP request brings the executor, read from the wire and bounded: its deadline and
its inputs.

The deadline is the transport's or Triton's `timeout` parameter, whichever comes first
(`deadline_of`). Inputs: raw contents (one per input, in order) or typed `contents`, never
both; shared memory is UNIMPLEMENTED. BYTES inputs are bounded before any decoding, and many of
them decode on a worker thread. The check against the loaded model's declaration is the
model's (`loaded_model.model_arrays`). Everything here raises `switchyard.errors`
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from switchyard import codec, oip_params
from switchyard.codec import WireTensor
from switchyard.errors import InvalidArgument, ResourceExhausted, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb

# BYTES inputs with more elements than this are decoded on a worker thread, not the event
# loop: splitting millions of length-prefixed elements takes seconds (64 MiB: about 8 s).
BYTES_INLINE_ELEMENTS = 4096


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


async def read_request(
    request: pb.ModelInferRequest, time_remaining: float | None, max_bytes_elements: int
) -> tuple[float | None, list[WireTensor]]:
    """What a request brings, in the order the data plane reads it: its deadline, counted from
    now (its arrival, not after a long decode), then its inputs (`read_inputs`)."""
    deadline = deadline_of(request.parameters, time_remaining)
    return deadline, await read_inputs(request, max_bytes_elements)


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
