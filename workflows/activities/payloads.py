"""Trial inputs and outputs on the wire: seeded tensors, OIP requests, base64 tensor payloads.

Inputs are regenerated from the spec's seed inside each activity instead of travelling
through Temporal, so every path (and every retry) sees exactly the same bytes. A file of
inputs is checked against its sha256 before use.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
from temporalio.exceptions import ApplicationError

from switchyard import oip_params
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.judge.tensors import encode
from workflows.pipeline.types import InputsPlan, TensorData

_NUMPY = {
    "FP64": np.float64,
    "FP32": np.float32,
    "FP16": np.float16,
    "BF16": np.float32,  # generated in float32, narrowed by the codec
    "INT64": np.int64,
    "INT32": np.int32,
    "INT16": np.int16,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}
MAX_OUTPUT_PAYLOAD = 1_500_000  # bytes per run: Temporal payloads are limited to ~2 MB


def inputs_dir() -> Path:
    """The one folder `inputs.file` may name a file in: $SWITCHYARD_INPUTS_DIR, else var/inputs."""
    return Path(os.environ.get("SWITCHYARD_INPUTS_DIR", "") or "var/inputs")


def inputs_file(name: str) -> Path:
    """`name` (relative to inputs_dir(), or absolute inside it) as a path in that folder, after
    resolving links and `..`: a spec reads no other file the worker can."""
    folder = inputs_dir().resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder) or path == folder:
        raise ApplicationError(
            f"inputs.file {name[:200]!r} is outside the worker's inputs folder {folder}; put the file "
            "there and name it relative to it (the worker's SWITCHYARD_INPUTS_DIR)",
            type="InputsOutsideFolder",
            non_retryable=True,
        )
    return path


def _load_file(plan: InputsPlan) -> dict[str, npt.NDArray[np.generic]]:
    path = inputs_file(plan.file)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise ApplicationError(f"inputs.file {plan.file}: {exc.strerror}", non_retryable=True) from None
    if hashlib.sha256(blob).hexdigest() != plan.file_sha256:  # its hash is not said: it is the worker's file
        raise ApplicationError(
            f"inputs.file {plan.file} does not hash to inputs.file_sha256 {plan.file_sha256}; give "
            "the sha256 of the file you put in the inputs folder",
            type="InputsChecksum",
            non_retryable=True,
        )
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


def workloads_dir() -> Path:
    """Where the worker finds captured workloads: $SWITCHYARD_WORKLOADS_DIR, else var/workloads
    (the router's default workloads_dir)."""
    return Path(os.environ.get("SWITCHYARD_WORKLOADS_DIR", "") or "var/workloads")


def workload_requests(plan: InputsPlan) -> list[oip.ModelInferRequest]:
    """The captured requests of `plan.workload` in order, after checking the file's sha256."""
    from switchyard.errors import SwitchyardError
    from switchyard.judge.capture_format import find_workload, read_records

    try:
        path, _ = find_workload(workloads_dir(), plan.workload)
        requests = read_records(path, plan.workload_sha256, oip.ModelInferRequest.FromString)
    except SwitchyardError as exc:
        raise ApplicationError(f"inputs.workload: {exc}", type="InputsChecksum", non_retryable=True) from None
    if not requests:
        raise ApplicationError(f"inputs.workload {plan.workload} holds no requests", non_retryable=True)
    return requests


def retarget(
    request: oip.ModelInferRequest, model: str, version: str, request_id: str = ""
) -> oip.ModelInferRequest:
    out = oip.ModelInferRequest()
    out.CopyFrom(request)
    out.model_name, out.model_version, out.id = model, version, request_id
    out.parameters[oip_params.STATS].bool_param = True  # compute_us: the trial's busy time
    return out


def make_inputs(plan: InputsPlan, batch: int | None = None) -> list[tuple[str, str, npt.NDArray[np.generic]]]:
    """(name, datatype, array) per input; `batch` overrides the spec's batch dimension.
    For a workload: the first captured request's inputs (shapes as captured)."""
    out: list[tuple[str, str, npt.NDArray[np.generic]]] = []
    if plan.workload:
        first = workload_requests(plan)[0]
        for i, tensor in enumerate(first.inputs):
            kind = np.uint16 if tensor.datatype == "BF16" else _NUMPY.get(tensor.datatype, np.float32)
            captured: npt.NDArray[np.generic] = np.frombuffer(first.raw_input_contents[i], dtype=kind)
            captured = captured.reshape(list(tensor.shape))
            out.append((tensor.name, tensor.datatype, captured))
        return out
    if plan.file:
        for name, stored in _load_file(plan).items():
            datatype = {v: k for k, v in _NUMPY.items() if k != "BF16"}.get(stored.dtype.type, "FP32")
            if batch is not None:
                stored = np.resize(stored, (batch, *stored.shape[1:]))
            out.append((name, datatype, stored))
        return out
    rng = np.random.default_rng([plan.seed] if batch is None else [plan.seed, batch])
    for t in plan.tensors:
        shape = list(t.shape)
        if batch is not None:
            shape[0] = batch
        dtype = _NUMPY[t.datatype]
        if t.datatype in ("FP64", "FP32", "FP16", "BF16"):
            array: npt.NDArray[np.generic] = rng.normal(t.low, t.high, size=shape).astype(dtype)
        else:
            array = rng.integers(int(t.low), int(t.high), size=shape).astype(dtype)
        out.append((t.name, t.datatype, array))
    return out


def batch_of(plan: InputsPlan) -> int:
    return int(make_inputs(plan)[0][2].shape[0]) if plan.file else int(plan.tensors[0].shape[0])


def infer_request(
    model: str, version: str, inputs: list[tuple[str, str, npt.NDArray[np.generic]]], request_id: str = ""
) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    request.parameters[oip_params.STATS].bool_param = True  # compute_us: the trial's busy time
    for name, datatype, array in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(encode(array, datatype))
    return request


def outputs_of(response: oip.ModelInferResponse) -> list[TensorData]:
    tensors = []
    for i, output in enumerate(response.outputs):
        raw = response.raw_output_contents[i] if i < len(response.raw_output_contents) else b""
        tensors.append(
            TensorData(
                output.name, output.datatype, list(output.shape), base64.b64encode(raw).decode("ascii")
            )
        )
    return _fitting(tensors, "the correctness inputs", "use a smaller inputs batch or shape")


def _fitting(tensors: list[TensorData], what: str, fix: str) -> list[TensorData]:
    """`tensors`, if they fit in a Temporal payload (else a non-retryable error saying the fix)."""
    size = sum(len(t.data_b64) for t in tensors)
    if size > MAX_OUTPUT_PAYLOAD:
        raise ApplicationError(
            f"outputs of {what} are {size} bytes encoded, over the {MAX_OUTPUT_PAYLOAD} a Temporal "
            f"payload carries; {fix}",
            type="OutputsTooLarge",
            non_retryable=True,
        )
    return tensors


def combine(runs: list[list[TensorData]]) -> list[TensorData]:
    """One result from the outputs of many replayed requests: per output, every request's
    tensor as rows of its last dimension ([-1, last]), concatenated in request order, so
    element-wise and last-axis (logits) comparisons still line up across paths."""
    out: list[TensorData] = []
    for j, first in enumerate(runs[0]):
        blobs = [raw(r[j]) for r in runs]
        last = int(first.shape[-1]) if first.shape else 1
        rows = sum(int(np.prod(r[j].shape)) // max(last, 1) for r in runs)
        out.append(
            TensorData(first.name, first.datatype, [rows, last], base64.b64encode(b"".join(blobs)).decode())
        )
    fix = "export a smaller workload (fewer requests) for correctness"
    return _fitting(out, "the replayed workload", fix)


def raw(tensor: TensorData) -> bytes:
    return base64.b64decode(tensor.data_b64)


def sizes(inputs: list[tuple[str, str, npt.NDArray[np.generic]]]) -> dict[str, list[int]]:
    return {name: list(array.shape) for name, _, array in inputs}
