"""A small synchronous Python client for switchyard executors (and the router, for infer).

    with ExecutorClient("127.0.0.1:8101") as client:
        result = client.infer("mlp", {"x": np.zeros((1, 64), np.float32)})
        result.outputs["y"], result.parameters["compute_us"]

Numpy in, numpy out, over raw contents (BF16 outputs widen exactly to float32). Errors are
`grpc.RpcError` with the server's status and message.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from switchyard import codec, net, oip_params
from switchyard.gen.inference import grpc_service_pb2 as oip
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc


@dataclass(frozen=True)
class InferResult:
    outputs: dict[str, np.ndarray]
    parameters: dict[str, str | int | float | bool]
    model_version: str


def parameter_values(params: Any) -> dict[str, str | int | float | bool]:
    """OIP InferParameter map -> plain Python values."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


class ExecutorClient:
    """`api_key` goes with every OIP call as `authorization: Bearer <key>` (the router needs one)."""

    def __init__(self, address: str, timeout_s: float = 30.0, api_key: str = "") -> None:
        self.channel = grpc.insecure_channel(address, options=net.CHANNEL_OPTIONS)
        self.oip = oip_grpc.GRPCInferenceServiceStub(self.channel)
        self.control = ctl_grpc.ExecutorControlStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def infer(
        self, model: str, inputs: dict[str, np.ndarray], version: str = "", timeout_s: float | None = None
    ) -> InferResult:
        request = build_infer_request(model, inputs, version)
        response = self.oip.ModelInfer(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        return parse_infer_response(response)

    def ready(self, model: str = "") -> bool:
        if model:
            request = oip.ModelReadyRequest(name=model)
            return bool(self.oip.ModelReady(request, timeout=self.timeout_s, metadata=self.metadata).ready)
        return bool(self.oip.ServerReady(oip.ServerReadyRequest(), timeout=self.timeout_s).ready)

    def describe(self) -> dict[str, Any]:
        return MessageToDict(self.control.Describe(ctl.DescribeRequest(), timeout=self.timeout_s))

    def load_model(self, model: str, **fields: Any) -> ctl.ModelStatus:
        request = ctl.LoadModelRequest(model_name=model, **fields)
        return self.control.LoadModel(request, timeout=max(self.timeout_s, 600.0)).model

    def unload(self, model: str, version: str = "") -> None:
        self.control.Unload(ctl.UnloadRequest(model_name=model, version=version), timeout=self.timeout_s)

    def status(self, model: str = "", version: str = "") -> list[ctl.ModelStatus]:
        request = ctl.ModelStatusRequest(model_name=model, version=version)
        return list(self.control.ModelStatus(request, timeout=self.timeout_s).models)

    def train(
        self, model: str, steps: int, lr: float = 0.01, seed: int = 0, batch_size: int = 8
    ) -> list[float]:
        request = ctl.TrainRequest(model_name=model, steps=steps, lr=lr, seed=seed, batch_size=batch_size)
        return list(self.control.Train(request, timeout=max(self.timeout_s, 600.0)).loss)

    def load_report(self) -> ctl.LoadReport:
        return self.control.GetLoad(ctl.GetLoadRequest(), timeout=self.timeout_s)


def build_infer_request(
    model: str, inputs: dict[str, np.ndarray], version: str = "", stats: bool = True
) -> oip.ModelInferRequest:
    """`stats`: ask for the executor's response parameters (timings, batch, load;
    `switchyard.oip_params`), which an operator's client shows; a bare request is answered
    without them."""
    request = oip.ModelInferRequest(model_name=model, model_version=version)
    if stats:
        request.parameters[oip_params.STATS].bool_param = True
    for name, array in inputs.items():
        datatype, raw = codec.encode_numpy(array)
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    return request


def parse_infer_response(response: oip.ModelInferResponse) -> InferResult:
    outputs = {
        out.name: codec.decode_numpy(out.datatype, out.shape, raw)
        for out, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }
    return InferResult(outputs, parameter_values(response.parameters), response.model_version)
