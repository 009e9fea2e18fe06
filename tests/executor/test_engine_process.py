"""The generation engine in a process of its own (the cpu default): where it runs, that it
stops with its model, a deadline that passes in its queue, a reload that takes the spare, a
first load that takes the one `executor serve` started before its own imports, what
a lost engine process does to its requests, a failed load's error, and the setting's check.
The engine's own behaviour through the process (exact tokens, continuous batching,
cancellation, the queue's bound, bad input) is tested in test_generation.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.cli import build_parser
from clients.executor_cli import loads_a_causal_lm
from services.executor.device import select_backend
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_runtime import Executor
from services.executor.executor_server import start_executor
from services.executor.generation import engine_launch
from services.executor.generation.engine_process import EngineProcess, RemoteEngine
from services.executor.generation.settings import SamplingParams
from switchyard.errors import DeadlineExceeded, InvalidArgument, Unavailable
from switchyard.models.registry import ModelRegistry
from switchyard.models.repository import CheckpointMismatch, seed_builtins
from tests.conftest import ROOT
from tests.gen_models import add_tiny_lm_variant, repository_with_llama, tiny_lm_reference


def _executor(root: Path) -> Executor:
    seed_builtins(root, ["tiny-lm-gen"])
    return Executor(ExecutorConfig(), select_backend("cpu"), ModelRegistry(root))


async def test_the_engine_runs_in_a_child_process_that_stops_with_its_model(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    try:
        m = await ex.load_model("tiny-lm-gen", "", ex.default_options())
        assert isinstance(m.engine, RemoteEngine) and isinstance(m.generation, EngineProcess)
        child = m.generation.process
        assert child.pid != os.getpid() and child.poll() is None
        assert m.times.compile_s > 0 and m.findings.adaptations  # the child's load, reported here
        stream = ex.generate(m, list(b"hello"), SamplingParams(temperature=0.0, max_tokens=12), False, None)
        tokens = [t async for e in stream for t in e.token_ids]
        assert tokens == tiny_lm_reference(list(b"hello"), 12)
        assert stream.output_tokens == 12 and stream.busy_us > 0
        await ex.unload("tiny-lm-gen", "")
        assert child.returncode == 0  # asked to leave, and it left
    finally:
        await ex.close()


async def test_the_first_load_takes_the_engine_process_started_ahead(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    engine_launch.prestart()
    ahead = engine_launch.SPARE._child
    try:
        assert ahead is not None
        m = await ex.load_model("tiny-lm-gen", "", ex.default_options())
        assert isinstance(m.generation, EngineProcess) and m.generation.process is ahead[0]
    finally:
        await ex.close()


def test_executor_serve_starts_an_engine_ahead_only_for_a_causal_lm_on_cpu(tmp_path: Path) -> None:
    seed_builtins(tmp_path, ["tiny-lm-gen", "mlp"])

    def ahead(*args: str) -> bool:
        parsed = build_parser().parse_args(["executor", "serve", "--model-repository", str(tmp_path), *args])
        return loads_a_causal_lm(parsed)

    assert ahead("--models", "mlp,tiny-lm-gen:1")
    assert not ahead("--models", "mlp,no-such-model")
    assert not ahead("--models", "tiny-lm-gen", "--generation-engine", "inline")
    assert not ahead("--models", "tiny-lm-gen", "--backend", "xla")


# The child's own loop, run in a fresh interpreter with its load already waiting (as for a child
# started for that load, or a spare taken while it imported torch): what it imported is then
# visible. serve() returns at the Close that follows the load.
_LOAD_WAITING = """
import multiprocessing, sys
from pathlib import Path
from services.executor.device import select_backend
from services.executor.executor_config import ExecutorConfig
from services.executor.executor_runtime import Executor
from services.executor.generation import engine_child
from services.executor.generation.engine_messages import Close, Load
from switchyard.models.registry import ModelRegistry
ex = Executor(ExecutorConfig(), select_backend("cpu"), ModelRegistry(Path(sys.argv[1])))
parent, child = multiprocessing.Pipe()
parent.send(Load(ex.registry.get("tiny-lm-gen", ""), ex.default_options(), "cpu", 1))
parent.send(Close())
engine_child.serve(child)
print(type(parent.recv()).__name__, any(m.startswith("transformers") for m in sys.modules))
"""


def test_an_engine_process_with_its_load_waiting_imports_transformers_only_for_its_format(
    tmp_path: Path,
) -> None:
    """The hf format's modelling (2 of a child's 3 s start on this host) is imported ahead only
    by a spare that waits for a load: a built-in model's engine does not wait for it."""
    seed_builtins(tmp_path, ["tiny-lm-gen"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_WAITING, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Ready", "False"], out.stderr


async def test_a_deadline_that_passes_in_the_engine_process_queue_is_deadline_exceeded(
    tmp_path: Path,
) -> None:
    """The deadline crosses into the child as a perf_counter instant (one clock on Linux)."""
    add_tiny_lm_variant(tmp_path, "one-slot", decode_slots=1, max_queue=4)
    ex = _executor(tmp_path)
    try:
        m = await ex.load_model("one-slot", "", ex.default_options())
        long = SamplingParams(temperature=0.0, max_tokens=50)
        first = ex.generate(m, list(b"first"), long, False, None)
        it = first.__aiter__()
        await anext(it)  # it holds the only slot
        late = ex.generate(m, list(b"late"), long, False, time.perf_counter() + 0.001)
        with pytest.raises(DeadlineExceeded, match="while the request waited for a decode slot"):
            await asyncio.wait_for(anext(late.__aiter__()), 30)
        first.cancel()
    finally:
        await ex.close()


async def test_a_reload_takes_the_spare_engine_process(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    add_tiny_lm_variant(tmp_path, "tiny-lm-gen-again")
    try:
        await ex.load_model("tiny-lm-gen", "", ex.default_options())
        spare = engine_launch.SPARE._child  # started once that load was warm
        assert spare is not None and spare[0].poll() is None
        m = await ex.load_model("tiny-lm-gen-again", "", ex.default_options())
        assert isinstance(m.generation, EngineProcess) and m.generation.process is spare[0]
        stream = ex.generate(m, list(b"spare"), SamplingParams(temperature=0.0, max_tokens=6), False, None)
        assert [t async for e in stream for t in e.token_ids] == tiny_lm_reference(list(b"spare"), 6)
    finally:
        await ex.close()


async def test_a_lost_engine_process_fails_its_requests_with_unavailable(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    try:
        m = await ex.load_model("tiny-lm-gen", "", ex.default_options())
        assert isinstance(m.generation, EngineProcess)
        stream = ex.generate(m, list(b"long"), SamplingParams(temperature=0.0, max_tokens=50), False, None)
        it = stream.__aiter__()
        await anext(it)
        os.kill(m.generation.process.pid, signal.SIGKILL)
        with pytest.raises(Unavailable, match="generation engine exited"):
            while True:  # the tokens already sent, then the error
                await anext(it)
        with pytest.raises(Unavailable, match="load the model again"):
            ex.generate(m, list(b"next"), SamplingParams(max_tokens=2), False, None)
    finally:
        await ex.close()


async def test_a_failed_load_raises_the_engine_process_error(tmp_path: Path, llama_dir: Path) -> None:
    ex = Executor(ExecutorConfig(), select_backend("cpu"), repository_with_llama(tmp_path, llama_dir))
    (weights,) = (tmp_path / "llama-tiny" / "1").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes() + b"\0")
    try:
        with pytest.raises(CheckpointMismatch, match="hashes to"):
            await ex.load_model("llama-tiny", "", ex.default_options())
        assert not ex.models and not ex.loading
    finally:
        await ex.close()


async def test_an_unknown_generation_engine_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="generation_engine is 'thread'; use one of"):
        await start_executor(ExecutorConfig(generation_engine="thread"))
