"""Reference models: committed checkpoints match their sha256, minilm-l6 matches
sentence-transformers, the perturbed variants fail the tolerance of docs/architecture.md#trials,
user models load."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton
from safetensors.torch import save_file

from clients.executor_client import build_infer_request, parse_infer_response
from clients.model_admin import add_model
from services.executor.executor_server import RunningExecutor
from switchyard.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models import minilm
from switchyard.models.registry import ModelRegistry, file_sha256, load_module
from tests.executor.user_model import Scaler, add_user_model

REGISTRY = ModelRegistry.with_builtins()
SENTENCES = [
    "switchyard routes inference.",
    "A cat sits on the mat.",
    "Hardware-neutral serving for PyTorch models!",
]


def _tokenize(seq: int = 24) -> np.ndarray:
    """The model's own tokenizer.json (the `tokenizers` library; transformers is slow to import)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm.checkpoint_path().parent / "tokenizer.json"))
    tokenizer.enable_padding(length=seq, pad_id=0)
    tokenizer.enable_truncation(seq)
    return np.array([e.ids for e in tokenizer.encode_batch(SENTENCES)], dtype=np.int64)


def test_checkpoints_hash_to_the_registry() -> None:
    for name in ("mlp", "tiny-lm", "minilm-l6"):
        spec = REGISTRY.get(name)
        assert file_sha256(spec.folder / "model.safetensors") == spec.sha256, name
    assert (REGISTRY.get("tiny-lm").folder / "model.safetensors").stat().st_size < 4_000_000


@pytest.mark.slow
def test_minilm_matches_transformers_bert_with_sentence_transformers_pooling() -> None:
    """The reference is transformers' BertModel plus the pipeline sentence-transformers runs for
    this checkpoint (modules.json: Transformer, mean Pooling, Normalize)."""
    from transformers import BertModel

    ids = _tokenize()
    bert = BertModel.from_pretrained(str(minilm.checkpoint_path().parent))
    bert.train(False)
    mask = torch.from_numpy((ids != 0).astype(np.int64))
    with torch.inference_mode():
        hidden = bert(input_ids=torch.from_numpy(ids), attention_mask=mask).last_hidden_state
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        reference = torch.nn.functional.normalize(pooled, dim=1).numpy()
    module = load_module(REGISTRY.get("minilm-l6"))
    with torch.inference_mode():
        ours = module(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(ours, reference, atol=2e-6, rtol=1e-5)
    # the padding in ids must not matter: mean pooling skips it
    with torch.inference_mode():
        longer = module(torch.from_numpy(np.pad(ids, ((0, 0), (0, 8))))).numpy()
    np.testing.assert_allclose(longer, ours, atol=2e-6)


async def test_minilm_served_equals_in_process(executor: RunningExecutor) -> None:
    async with grpc.aio.insecure_channel(executor.address) as channel:
        loaded = await ctl_grpc.ExecutorControlStub(channel).LoadModel(
            ctl.LoadModelRequest(model_name="minilm-l6", batch_buckets=[1, 4])
        )
    assert loaded.model.state == "READY"
    ids = _tokenize()
    client = triton.InferenceServerClient(executor.address)
    try:
        assert await client.is_model_ready("minilm-l6")
        meta = await client.get_model_metadata("minilm-l6", as_json=True)
        assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": ["-1", "384"]}]
        inp = triton.InferInput("input_ids", list(ids.shape), "INT64")
        inp.set_data_from_numpy(ids)
        got = (await client.infer("minilm-l6", [inp])).as_numpy("embedding")
    finally:
        await client.close()
    with torch.inference_mode():
        expected = load_module(REGISTRY.get("minilm-l6"))(torch.from_numpy(ids)).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", ["mlp", "tiny-lm"])
def test_perturbed_variant_fails_the_design_tolerance(name: str) -> None:
    spec = REGISTRY.get(name)
    inputs = spec.example_inputs(4, torch.Generator().manual_seed(3))
    wide = [x.double() if x.is_floating_point() else x for x in inputs]
    with torch.inference_mode():
        golden = load_module(spec).double()(*wide)
        fp32 = load_module(spec)(*inputs).double()
        perturbed = load_module(REGISTRY.get(name, "perturbed"))(*inputs).double()
        again = load_module(REGISTRY.get(name, "perturbed"))(*inputs).double()
    assert torch.equal(perturbed, again)  # seeded: the same in every process
    reference_error = (fp32 - golden).abs().max()
    perturbed_error = (perturbed - golden).abs().max()
    # docs/architecture.md#trials: a candidate may be at most 2x the reference path's own error (fp32)
    assert perturbed_error > 1000 * max(float(reference_error), 1e-12)
    cosine = torch.nn.functional.cosine_similarity(perturbed.flatten(), golden.flatten(), dim=0)
    assert cosine < 0.9999


async def test_user_model_from_factory_and_safetensors(executor: RunningExecutor, tmp_path: Path) -> None:
    torch.manual_seed(5)
    module = Scaler()
    root = executor.executor.registry.root
    sha = add_user_model(root, "scaler", "tests.executor.user_model:build", module)
    assert sha == file_sha256(root / "scaler" / "1" / "model.safetensors")
    features = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    async with grpc.aio.insecure_channel(executor.address) as channel:
        control = ctl_grpc.ExecutorControlStub(channel)
        status = await control.LoadModel(ctl.LoadModelRequest(model_name="scaler", batch_buckets=[1, 4]))
        assert status.model.checkpoint_sha256 == sha
        response = await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            build_infer_request("scaler", {"features": features})
        )
        with torch.inference_mode():
            expected = module(torch.from_numpy(features)).numpy()
        np.testing.assert_array_equal(parse_infer_response(response).outputs["score"], expected)

    # A broken factory is refused when it is added (validation loads it), so it never
    # reaches an executor; nothing of it is left in the repository.
    factory = "tests.executor.user_model:"
    cases: list[tuple[str, str, type[Exception], str]] = [
        ("bad", f"{factory}nope", FailedPrecondition, "cannot be imported"),
        ("bad", "no_colon", FailedPrecondition, "package.module:function"),
        ("bad", f"{factory}not_a_user_model", InvalidArgument, "declare [[inputs]]"),
        ("mlp", f"{factory}build", AlreadyExists, "already exists"),  # the built-in's version 1
    ]
    for name, factory_path, error, text in cases:
        source = _factory_source(tmp_path, factory_path, module)
        with pytest.raises(error) as raised:
            add_model(root, name, source, version="1", allowed_factories=("tests",))
        assert text in str(raised.value), raised.value
    assert not (root / "bad").exists()
    source = _factory_source(tmp_path, f"{factory}build", module)
    (source / "model.safetensors").unlink()  # the weights the factory needs are not there
    with pytest.raises(InvalidArgument, match="holds no artifact files"):
        add_model(root, "bad", source, allowed_factories=("tests",))
    assert not (root / "bad").exists()


def _factory_source(tmp_path: Path, function: str, module: torch.nn.Module) -> Path:
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    (source / "model.toml").write_text(f'format = "factory"\n[factory]\nfunction = "{function}"\n')
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(source / "model.safetensors"))
    return source


async def test_a_model_bug_is_internal_without_a_traceback_and_the_server_goes_on(
    executor: RunningExecutor, tmp_path: Path
) -> None:
    add_user_model(
        executor.executor.registry.root, "failing", "tests.executor.user_model:build_failing", Scaler()
    )
    async with grpc.aio.insecure_channel(executor.address) as channel:
        await ctl_grpc.ExecutorControlStub(channel).LoadModel(
            ctl.LoadModelRequest(model_name="failing", batch_buckets=[1])
        )
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        huge = np.full((1, 4), 1e9, np.float32)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(build_infer_request("failing", {"features": huge}))
        details = info.value.details() or ""
        assert info.value.code() == grpc.StatusCode.INTERNAL and "reference" in details
        assert "secret" not in details and "Traceback" not in details and "ValueError" not in details
        ok = await stub.ModelInfer(build_infer_request("failing", {"features": np.zeros((1, 4), np.float32)}))
        assert ok.outputs[0].shape == [1, 2]
