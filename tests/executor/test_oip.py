"""tritonclient.grpc against a real executor: liveness, metadata, config, and exact outputs.

Outputs must equal an in-process eager fp32 call of the same checkpoint bit for bit (same
CPU, same kernels, same batch composition: a lone request runs unpadded in eager mode).
"""

from __future__ import annotations

import numpy as np
import torch
import tritonclient.grpc.aio as triton

from services.executor.executor_server import RunningExecutor
from switchyard import oip_params
from switchyard.models.registry import ModelRegistry, load_module


def _reference(model: str, *inputs: np.ndarray) -> np.ndarray:
    module = load_module(ModelRegistry.with_builtins().get(model))
    with torch.inference_mode():
        return module(*[torch.from_numpy(x) for x in inputs]).numpy()  # type: ignore[no-any-return]


async def test_server_and_model_endpoints(executor: RunningExecutor) -> None:
    client = triton.InferenceServerClient(executor.address)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("mlp")
        assert await client.is_model_ready("tiny-lm")
        meta = await client.get_model_metadata("tiny-lm", as_json=True)
        assert meta["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": ["-1", "-1"]}]
        assert meta["outputs"][0]["shape"] == ["-1", "-1", "512"]
        config = (await client.get_model_config("mlp", as_json=True))["config"]
        assert config["max_batch_size"] == 8
        assert config["input"][0]["dims"] == ["64"] and config["input"][0]["data_type"] == "TYPE_FP32"
        assert config["dynamic_batching"]["preferred_batch_size"] == [1, 2, 4, 8]
        assert config["parameters"]["checkpoint_sha256"]["string_value"] == (
            ModelRegistry.with_builtins().get("mlp").sha256
        )
    finally:
        await client.close()


async def test_mlp_and_tiny_lm_outputs_equal_in_process_call(executor: RunningExecutor) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ids = rng.integers(0, 512, (2, 20)).astype(np.int64)
    client = triton.InferenceServerClient(executor.address)
    try:
        for model, name, array, out in (("mlp", "x", x, "y"), ("tiny-lm", "input_ids", ids, "logits")):
            inp = triton.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
            inp.set_data_from_numpy(array)
            result = await client.infer(model, [inp], parameters={oip_params.STATS: True})
            got = result.as_numpy(out)
            np.testing.assert_array_equal(got, _reference(model, array))
            params = result.get_response().parameters
            assert params[oip_params.BACKEND].string_param == "cpu"
            assert params[oip_params.MODE].string_param == "eager"
            assert params[oip_params.COMPUTE_US].int64_param > 0
            assert params[oip_params.QUEUE_US].int64_param >= 0
            assert params[oip_params.BATCH_SIZE].int64_param == array.shape[0]
            assert params[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param == 0
            assert params[oip_params.IN_FLIGHT].int64_param == 0  # nothing else was running
    finally:
        await client.close()


async def test_response_parameters_only_when_the_request_asks(executor: RunningExecutor) -> None:
    """Like Triton's statistics, timings and load are opt-in: a bare request gets the bare
    answer (the same outputs), one with `switchyard_stats` gets every documented key."""
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    client = triton.InferenceServerClient(executor.address)
    try:
        inp = triton.InferInput("x", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        bare = await client.infer("mlp", [inp], request_id="r1")
        asked = await client.infer("mlp", [inp], request_id="r2", parameters={oip_params.STATS: True})
    finally:
        await client.close()
    assert dict(bare.get_response().parameters) == {}
    assert bare.get_response().id == "r1" and bare.get_response().model_name == "mlp"
    np.testing.assert_array_equal(bare.as_numpy("y"), asked.as_numpy("y"))
    np.testing.assert_array_equal(bare.as_numpy("y"), _reference("mlp", x))
    assert set(asked.get_response().parameters) == {*oip_params.STRING_KEYS, *oip_params.INT_KEYS}
    assert asked.get_response().id == "r2"


async def test_typed_contents_equal_raw_contents(executor: RunningExecutor) -> None:
    import grpc

    from clients.executor_client import build_infer_request, parse_infer_response
    from switchyard.gen.inference import grpc_service_pb2 as oip
    from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc

    ids = np.arange(10, dtype=np.int64)[None]
    typed = oip.ModelInferRequest(model_name="tiny-lm")
    tensor = typed.inputs.add(name="input_ids", datatype="INT64", shape=[1, 10])
    tensor.contents.int64_contents.extend(ids.ravel().tolist())
    async with grpc.aio.insecure_channel(executor.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        from_typed = parse_infer_response(await stub.ModelInfer(typed)).outputs["logits"]
        from_raw = parse_infer_response(
            await stub.ModelInfer(build_infer_request("tiny-lm", {"input_ids": ids}))
        )
    np.testing.assert_array_equal(from_typed, from_raw.outputs["logits"])
