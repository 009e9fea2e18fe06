"""An OIP request's inputs on the executor: read from the wire, bounded, and checked against
the loaded model's declaration; and the request's deadline.

Raw contents (one per input, in order) or typed `contents`, never both; shared memory is
UNIMPLEMENTED. The check (names, datatypes, ranks, dims, one batch size) runs in full once per
signature (names, datatypes, shapes): steady traffic pays a dict lookup instead. Float inputs
are accepted as the loaded precision's datatype or as FP32 (trials send the same FP32 inputs
to every path). Everything here raises `switchyard.errors` (INVALID_ARGUMENT, UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from services.executor.loaded_model import LoadedModel
from switchyard import codec, oip_params
from switchyard.codec import WireTensor
from switchyard.errors import InvalidArgument, ResourceExhausted, Unimplemented
from switchyard.gen.inference import grpc_service_pb2 as pb

# BYTES inputs with more elements than this are decoded on a worker thread, not the event
# loop: splitting millions of length-prefixed elements takes seconds (64 MiB: about 8 s).
BYTES_INLINE_ELEMENTS = 4096

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

# a signature (names, datatypes, shapes) -> the position of each declared input in the request
Signatures = dict[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[int, ...]]


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


async def read_inputs(
    request: pb.ModelInferRequest, max_bytes_elements: int
) -> tuple[list[WireTensor], bool]:
    """A tensor request's inputs, decoded, and whether that waited: BYTES inputs are bounded
    before any decoding (RESOURCE_EXHAUSTED over `max_bytes_elements`), and many of them decode
    on a worker thread, not the event loop."""
    for tensor in request.inputs:
        if tensor.datatype == "BYTES":
            break
    else:
        return decode_inputs(request), False
    elements = bytes_elements(request)
    if elements > max_bytes_elements:
        raise ResourceExhausted(
            f"the request has {elements} BYTES elements; this executor takes at most "
            f"{max_bytes_elements} per request: split it"
        )
    if elements > BYTES_INLINE_ELEMENTS:
        return await asyncio.to_thread(decode_inputs, request), True
    return decode_inputs(request), False


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


def model_arrays(
    model: LoadedModel, signatures: Signatures, inputs: list[WireTensor]
) -> tuple[list[np.ndarray], int]:
    """The arrays of `inputs` in the model's declared order, and their rows; a signature that
    passed once is remembered in `signatures` (the model's own, kept by the data plane)."""
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
    ranks, dims, one batch size); the arrays in declared order and the rows."""
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


def deadline_of(request: pb.ModelInferRequest, remaining: float | None) -> float | None:
    """time.perf_counter() seconds when the request must be out of the queue: the transport's
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


def trace_carrier(params: Any) -> dict[str, str]:
    """The trace context a request carries in its parameters (the router sets them)."""
    return {k: params[k].string_param for k in (oip_params.TRACEPARENT, oip_params.TRACESTATE) if k in params}
