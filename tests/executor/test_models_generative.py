"""`switchyard models add|validate` of generative models: a Llama folder with a tokenizer.json
becomes a generative entry in one command, and validation generates greedily through the
executor's engine and checks the ids against the model's own decoding (here against
references computed by the tests' own helpers: transformers' generate(), tiny-lm's forward
passes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clients.cli import main as switchyard
from clients.model_admin import add_model
from clients.model_generation import MAX_CONTEXT, PROMPT, generation_table
from switchyard.errors import InvalidArgument
from switchyard.models.generation import GenerationSettings
from switchyard.models.manifest import read_model_toml
from switchyard.models.repository import BUILTIN, CHECKPOINTS, seed_builtins
from tests.gen_models import build_llama, reference_greedy, tiny_lm_reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("llama") / "llama", seed=3)


def _validate_json(capsys: pytest.CaptureFixture[str], repo: Path, name: str) -> dict[str, object]:
    capsys.readouterr()
    assert switchyard(["models", "validate", name, "--repository", str(repo), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert isinstance(report, dict)
    return report


def test_a_llama_folder_becomes_a_generative_entry_in_one_command(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    assert switchyard(["models", "add", "my-llama", str(llama), "--repository", str(repo)]) == 0
    assert "equals the model's own" in capsys.readouterr().out
    m = read_model_toml(repo / "my-llama")
    config = json.loads((llama / "config.json").read_text())
    settings = GenerationSettings.from_table(m.generation_table())  # the engine accepts it
    assert settings.max_context == config["max_position_embeddings"]
    assert settings.max_new_tokens + settings.max_prompt == settings.max_context
    assert [s.name for s in m.inputs][:3] == ["text_input", "stream", "sampling_parameters"]
    assert m.hf is not None and m.hf.model_class == "LlamaForCausalLM"
    version = m.version("1")
    assert version is not None and "tokenizer.json" in dict(version.files)

    report = _validate_json(capsys, repo, "my-llama")
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(llama / "tokenizer.json")).encode(PROMPT).ids
    assert report["prompt_tokens"] == len(prompt)
    assert report["generated_ids"] == reference_greedy(llama, prompt, 8)
    assert report["agrees"] is True and report["reference"] == "transformers generate()"


def test_no_generation_keeps_the_logits_entry_and_generation_needs_a_tokenizer(
    llama: Path, tmp_path: Path
) -> None:
    spec, checked = add_model(tmp_path / "repo", "logits", llama, generation=False)
    assert spec.generation is None and [s.name for s in spec.outputs] == ["logits"]
    assert checked.generated is None and checked.output_shapes[0][0] == "logits"
    bare = tmp_path / "bare"
    shutil.copytree(llama, bare)
    (bare / "tokenizer.json").unlink()
    # without a tokenizer.json nothing is inferred: the folder stays a logits model
    inferred, _ = add_model(tmp_path / "repo", "bare", bare)
    assert inferred.generation is None
    with pytest.raises(InvalidArgument, match=r"has no tokenizer\.json; a generative model needs one"):
        add_model(tmp_path / "repo", "bare-gen", bare, generation=True)
    assert not (tmp_path / "repo" / "bare-gen").exists()


def test_the_generation_table_follows_the_model_limits() -> None:
    long = generation_table({"max_position_embeddings": 32768})
    assert long["max_context"] == MAX_CONTEXT
    GenerationSettings.from_table(long)  # at most 8 prompt buckets, within the context
    short = generation_table({"max_position_embeddings": 20})
    assert short["max_context"] == 20 and short["prompt_buckets"][-1] + short["max_new_tokens"] == 20
    GenerationSettings.from_table(short)
    with pytest.raises(InvalidArgument, match="max_position_embeddings is 0"):
        generation_table({})


def test_the_builtin_validates_and_adds_as_a_factory_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    seed_builtins(repo, ["tiny-lm-gen"])
    report = _validate_json(capsys, repo, "tiny-lm-gen")
    assert report["generated_ids"] == tiny_lm_reference(list(PROMPT.encode()), 8)
    assert report["agrees"] is True
    source = tmp_path / "src"
    source.mkdir()
    shutil.copyfile(BUILTIN / "tiny-lm-gen" / "model.toml", source / "model.toml")
    shutil.copyfile(CHECKPOINTS / "tiny_lm.safetensors", source / "model.safetensors")
    spec, checked = add_model(tmp_path / "other", "my-gen", source)
    assert spec.generation is not None and checked.generated is not None
    assert checked.output_shapes == (("output_ids", (1, 8)),)


def test_several_names_validate_in_one_command_each_with_its_own_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One command for several entries (on xla: one re-exec, one torch_xla start-up for all); each
    # keeps the report it has alone, in the order given, a generative one and a plain one alike.
    repo = tmp_path / "repo"
    seed_builtins(repo, ["tiny-lm-gen", "mlp"])
    argv = ["models", "validate", "tiny-lm-gen", "mlp", "--repository", str(repo)]
    capsys.readouterr()
    assert switchyard([*argv, "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in reports] == ["tiny-lm-gen", "mlp"]
    assert reports[0]["generated_ids"] == tiny_lm_reference(list(PROMPT.encode()), 8)
    assert reports[1]["outputs"] == {"y": [2, 16]} and reports[1]["backend"] == "cpu"
    assert switchyard(argv) == 0
    text = capsys.readouterr().out
    assert "tiny-lm-gen:1 on cpu" in text and "mlp:1 on cpu" in text
    assert text.index("tiny-lm-gen:1") < text.index("mlp:1")
