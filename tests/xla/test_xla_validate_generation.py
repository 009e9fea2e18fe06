"""`switchyard models validate NAME --backend xla` of generative models: a Llama folder that
`switchyard models add` made generative (sized as docs/generation.md types it), and the
built-in tiny-lm-gen, generate greedily through the engine on XLA (the command re-runs itself
under SWITCHYARD_XLA_PYTHON) and give the ids of the model's own decoding on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clients.cli import main as switchyard
from clients.model_generation import PROMPT
from switchyard.models.repository import Repository, seed_builtins
from tests.conftest import ROOT
from tests.gen_models import LLAMA_TINY_SIZES, build_llama, reference_greedy, tiny_lm_reference
from tests.xla.conftest import require_xla_env

pytestmark = pytest.mark.xla


def _validate_on_xla(repository: Path, *names: str) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}  # the command sets it
    env.update(SWITCHYARD_XLA_PYTHON=require_xla_env(), PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "clients.cli", "models", "validate", *names, "--backend", "xla"]
    argv += ["--repository", str(repository), "--json"]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    reports: list[dict[str, Any]] = json.loads(done.stdout)
    assert [r["model"] for r in reports] == list(names)
    return reports


def test_an_added_llama_and_the_builtin_generate_on_xla_as_on_the_cpu(tmp_path: Path) -> None:
    require_xla_env()
    llama = build_llama(tmp_path / "llama", seed=5)
    root = tmp_path / "repo"
    seed_builtins(root, ["tiny-lm-gen"])
    add = ["models", "add", "llama-tiny", str(llama), *LLAMA_TINY_SIZES, "--repository", str(root)]
    assert switchyard(add) == 0
    spec = Repository(root).get("llama-tiny")
    assert spec.generation is not None and spec.generation.prompt_buckets == (16,)
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(llama / "tokenizer.json")).encode(PROMPT).ids
    # One command for both, as an operator validates several: one torch_xla start-up, and each
    # entry still loads and generates on its own (its report is its own engine's).
    report, builtin = _validate_on_xla(root, "llama-tiny", "tiny-lm-gen")
    assert report["backend"] == "xla" and report["sha256"] == spec.sha256
    assert report["generated_ids"] == reference_greedy(llama, prompt, 8)
    assert builtin["backend"] == "xla"
    assert builtin["generated_ids"] == tiny_lm_reference(list(PROMPT.encode()), 8)
