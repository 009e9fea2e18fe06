"""`switchyard models add`'s generation sizes (--max-context, --max-new-tokens,
--prompt-buckets, --decode-slots, --decode-buckets): the `[generation]` table they make from a
model's config, and the INVALID_ARGUMENT, naming the option to fix, for sizes the engine or
the model cannot serve, refused before anything is copied."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.cli import main as switchyard
from clients.model_generation import GenerationSizes, generation_table
from switchyard.errors import InvalidArgument
from switchyard.models.generation import GenerationSettings
from switchyard.models.manifest import read_model_toml
from tests.gen_models import build_llama

CONFIG = {"max_position_embeddings": 128}
S = GenerationSizes


def test_the_options_size_the_table_and_the_rest_follows_from_them() -> None:
    small = GenerationSizes(max_context=64, max_new_tokens=40, prompt_buckets=(16,), decode_buckets=(4,))
    table = generation_table(CONFIG, small)
    assert table == {
        "max_context": 64,
        "max_new_tokens": 40,
        "prompt_buckets": [16],
        "decode_slots": 4,  # the widest decode bucket
        "decode_buckets": [4],
    }
    # new tokens fill what the largest prompt bucket leaves; half the context without buckets
    bucketed = generation_table(CONFIG, S(max_context=64, prompt_buckets=(8, 24)))
    assert bucketed["max_new_tokens"] == 40
    halves = generation_table(CONFIG, GenerationSizes(max_context=96, decode_slots=16))
    assert halves["max_new_tokens"] == 48 and halves["prompt_buckets"] == [8, 16, 32, 48]
    assert halves["decode_slots"] == 16 and "decode_buckets" not in halves
    # no options: the table the model's config alone gives
    assert generation_table(CONFIG) == {
        "max_context": 128,
        "max_new_tokens": 64,
        "prompt_buckets": [8, 16, 32, 64],
        "decode_slots": 8,
    }
    for sizes in (small, GenerationSizes(max_context=96, decode_slots=16)):
        GenerationSettings.from_table(generation_table(CONFIG, sizes))  # the engine accepts each


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (S(max_context=256), r"--max-context 256 must be 4 to the model's max_position_embeddings \(128"),
        (S(max_context=2), r"--max-context 2 must be 4 to"),
        (S(max_context=64, max_new_tokens=64), r"--max-new-tokens 64 must be 1 to max context - 1 \(63\)"),
        (S(prompt_buckets=(32, 16)), r"--prompt-buckets 32,16 must be increasing positive sizes"),
        (S(prompt_buckets=(0, 16)), r"--prompt-buckets 0,16 must be increasing"),
        (S(max_context=64, prompt_buckets=(16, 64)), r"the largest, 64, must be under the max context"),
        (S(prompt_buckets=tuple(range(1, 11))), r"--prompt-buckets has 10 sizes; at most 8"),
        (S(decode_slots=8, decode_buckets=(2, 4)), r"--decode-buckets must end at --decode-slots \(8\)"),
        (S(decode_buckets=(4, 4)), r"--decode-buckets 4,4 must be increasing"),
        (S(decode_slots=2000), r"a \[generation\] table the engine refuses: decode_slots is 2000"),
    ],
)  # fmt: skip
def test_sizes_the_engine_or_the_model_cannot_serve_say_what_to_fix(
    sizes: GenerationSizes, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        generation_table(CONFIG, sizes)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("llama") / "llama", seed=3)


def test_models_add_writes_the_sized_table_and_refuses_bad_sizes_leaving_nothing(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    add = ["models", "add", "small", str(llama), "--repository", str(repo)]
    assert switchyard([*add, "--max-model-len", "64", "--max-num-seqs", "2", "--prompt-buckets", "8,16"]) == 0
    table = read_model_toml(repo / "small").generation_table()
    assert table == {"max_context": 64, "max_new_tokens": 48, "prompt_buckets": [8, 16], "decode_slots": 2}
    capsys.readouterr()
    bad = ["models", "add", "bad", str(llama), "--repository", str(repo), "--prompt-buckets", "16,8"]
    assert switchyard(bad) == 2
    assert "--prompt-buckets 16,8 must be increasing positive sizes" in capsys.readouterr().err
    assert not (repo / "bad").exists()
    # a logits model has no [generation] to size; a new version keeps its model's table
    assert switchyard([*add[:2], "logits", *add[3:], "--no-generation", "--max-context", "64"]) == 2
    assert "--max-context: " in capsys.readouterr().err and not (repo / "logits").exists()
    assert switchyard([*add, "--max-context", "32"]) == 2
    assert "edit [generation] in its model.toml" in capsys.readouterr().err
    assert read_model_toml(repo / "small").generation_table() == table


def test_a_list_that_is_not_integers_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        switchyard(["models", "add", "x", "y", "--prompt-buckets", "16,thirty-two"])
    assert exit_.value.code == 2
    assert "expected comma-separated integers, e.g. 16,32" in capsys.readouterr().err
