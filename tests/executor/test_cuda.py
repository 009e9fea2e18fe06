"""The cuda backend where a GPU is present: the tensor built-ins, eager and compiled, against the
cpu reference over OIP; greedy generation on the device against the references; the process's
CUDA memory reported once used; `models validate --backend cuda`; and DDP on nccl against the
same run on gloo. Each skips, saying why, where torch sees no GPU: CI has none, and these run
where one is lent (docs/executor.md says when they last ran)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from clients.cli import main as switchyard
from clients.executor_client import build_infer_request, parse_infer_response
from services.executor import distributed, process_memory
from services.executor.device import select_backend
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_runtime import Executor
from services.executor.executor_server import start_executor
from services.executor.generation.engine_client import GenerationStream
from services.executor.generation.settings import SamplingParams
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc
from switchyard.models.registry import ModelRegistry, load_module
from switchyard.models.repository import seed_builtins
from tests.gen_models import (
    LLAMA_GENERATION,
    add_generative,
    add_tiny_lm_variant,
    reference_greedy,
    tiny_lm_reference,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU on this machine: cuda path unverified here"
)


def _examples() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        "mlp": {"x": rng.standard_normal((3, 64)).astype(np.float32)},
        "tiny-lm": {"input_ids": rng.integers(0, 256, (3, 16), dtype=np.int64)},
    }


def _cpu_reference(name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        module = load_module(ModelRegistry.with_builtins().get(name))
        out = module(*(torch.from_numpy(a) for a in inputs.values()))
    return np.asarray(out.numpy())


async def test_tensor_builtins_eager_and_compiled_match_the_cpu_reference(tmp_path: Path) -> None:
    seed_builtins(tmp_path, ["mlp", "tiny-lm"])
    config = ExecutorConfig(
        backend="cuda", models=("mlp", "tiny-lm"), batch_buckets=(1, 4), model_repository=str(tmp_path)
    )
    running = await start_executor(config)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            oip = oip_grpc.GRPCInferenceServiceStub(channel)
            control = ctl_grpc.ExecutorControlStub(channel)
            for mode in ("eager", "compile"):
                for name, inputs in _examples().items():
                    if mode == "compile":
                        loaded = await control.LoadModel(
                            ctl.LoadModelRequest(model_name=name, mode="compile", batch_buckets=[1, 4])
                        )
                        assert loaded.model.state == "READY" and loaded.model.mode == "compile"
                    response = await oip.ModelInfer(build_infer_request(name, inputs))
                    assert response.parameters["backend"].string_param == "cuda"
                    (got,) = parse_infer_response(response).outputs.values()
                    np.testing.assert_allclose(
                        got, _cpu_reference(name, inputs), rtol=1e-4, atol=1e-4, err_msg=f"{name} {mode}"
                    )
    finally:
        await running.stop(1)


async def _ids(stream: GenerationStream) -> list[int]:
    return [t async for e in stream for t in e.token_ids]


async def test_greedy_generation_on_the_device_equals_the_references(llama_dir: Path, tmp_path: Path) -> None:
    seed_builtins(tmp_path, ["tiny-lm-gen"])
    add_generative(tmp_path, "llama-tiny", llama_dir, LLAMA_GENERATION, "hf")
    ex = Executor(ExecutorConfig(backend="cuda"), select_backend("cuda"), ModelRegistry(tmp_path))
    try:
        for name in ("tiny-lm-gen", "llama-tiny"):
            await ex.load_model(name, "", ex.default_options())
        tiny = ex.find("tiny-lm-gen", "")
        prompts = [[(11 * i + 3 * j) % 256 for j in range(3 + (i * 7) % 28)] for i in range(6)]
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        streams = [ex.generate(tiny, p, greedy, False, None) for p in prompts]  # batched on the device
        results = await asyncio.gather(*(_ids(s) for s in streams))
        assert results == [tiny_lm_reference(p, 12) for p in prompts]

        llama = ex.find("llama-tiny", "")
        assert llama.engine is not None
        prompt = llama.engine.tokenizer.encode("a switchyard routes trains from")
        stream = ex.generate(llama, prompt, SamplingParams(temperature=0.0, max_tokens=16), True, None)
        assert await _ids(stream) == reference_greedy(llama_dir, prompt, 16)

        memory = process_memory.sample()
        assert memory.device_reported and memory.device_allocated_bytes > 0
    finally:
        await ex.close()


async def test_compiled_generation_serves_mixed_lengths_without_compiling_again(tmp_path: Path) -> None:
    # inductor on the device (Triton kernels): one prefill bucket and one decode width at load
    add_tiny_lm_variant(
        tmp_path, "tiny-lm-gen-compiled", prompt_buckets=[32], decode_slots=4, decode_buckets=[4]
    )
    ex = Executor(ExecutorConfig(backend="cuda"), select_backend("cuda"), ModelRegistry(tmp_path))
    try:
        options = dataclasses.replace(ex.default_options(), mode="compile")
        m = await ex.load_model("tiny-lm-gen-compiled", "", options)
        assert m.findings.during_load.compilations == 2
        prompts = [list(range(1, n + 1)) for n in (3, 17, 9, 30, 1, 12)]
        streams = [
            ex.generate(m, p, SamplingParams(temperature=0.0, max_tokens=4 + i), False, None)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(_ids(s) for s in streams))
        assert results == [tiny_lm_reference(p, 4 + i) for i, p in enumerate(prompts)]
        assert m.compilations_after_warmup() == 0
    finally:
        await ex.close()


def test_models_validate_on_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = ["mlp", "tiny-lm", "tiny-lm-gen"]
    seed_builtins(tmp_path, names)
    capsys.readouterr()
    argv = ["models", "validate", *names, "--backend", "cuda", "--repository", str(tmp_path), "--json"]
    assert switchyard(argv) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in reports] == names
    assert all(r["backend"] == "cuda" for r in reports)
    assert reports[2]["agrees"] is True, reports[2]


def test_ddp_on_nccl_follows_the_same_run_on_gloo() -> None:
    from services.executor.dist_launch import run_distributed
    from switchyard.models import tiny_lm

    world = min(2, torch.cuda.device_count())
    objective = (tiny_lm.train_batch, tiny_lm.batch_loss)
    torch.manual_seed(0)
    module = tiny_lm.build()  # each run trains its own copy of the same weights
    losses = {}
    for path in ("cuda", "cpu"):
        config = distributed.plan(path, world)
        run = run_distributed(module, *objective, torch.float32, config, 3, 0.05, 3, 4)
        assert run.ok, run.error
        assert run.config.backend == distributed.backend_for(path)
        losses[path] = run.loss
    # the same seeded steps on the same batches: equal up to the device's rounding
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-3)
    assert losses["cuda"][-1] < losses["cuda"][0]
