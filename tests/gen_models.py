"""A tiny Llama-style causal LM for generation tests: a transformers LlamaConfig with seeded
weights and a byte-level BPE tokenizer trained here, saved with save_pretrained; the
repositories and executors that serve it, the references its answers are checked against,
and the tritonclient inputs of a generation request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import tritonclient.grpc as triton

from switchyard.models.registry import ModelRegistry, file_sha256
from switchyard.models.repository import seed_builtins

if TYPE_CHECKING:
    from services.executor.executor_server import RunningExecutor

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a switchyard routes trains from one track to another",
    "serving language models one token at a time",
    "hello world, hello tokens, hello streams",
] * 8

LLAMA_GENERATION = {
    "max_context": 64,
    "max_new_tokens": 40,
    "prompt_buckets": [8, 16, 32],
    "decode_slots": 4,
}

# `switchyard models add llama-tiny FOLDER` sizes as docs/generation.md types them: one prefill
# bucket and one decode width, two graphs for a static-shape backend (xla) to compile
LLAMA_TINY_SIZES = (
    "--max-context", "64", "--max-new-tokens", "40", "--prompt-buckets", "16",
    "--decode-slots", "4", "--decode-buckets", "4",
)  # fmt: skip

Tensor = tuple[str, str, list[int]]  # name, datatype, dims


def io_toml(inputs: list[Tensor], outputs: list[Tensor]) -> str:
    """The `[[inputs]]` and `[[outputs]]` tables of a model.toml."""
    tables = [("inputs", t) for t in inputs] + [("outputs", t) for t in outputs]
    return "".join(
        f'\n[[{kind}]]\nname = "{n}"\ndatatype = "{d}"\ndims = {dims}\n' for kind, (n, d, dims) in tables
    )


# a generative model's tensors: Triton's vLLM backend's names, and the token ids both ways
IO = io_toml(
    [
        ("text_input", "BYTES", [1]),
        ("stream", "BOOL", [1]),
        ("sampling_parameters", "BYTES", [1]),
        ("input_ids", "INT64", [-1]),
    ],
    [("text_output", "BYTES", [-1]), ("output_ids", "INT64", [-1])],
)


def made_up_words(count: int, seed: int) -> list[str]:
    """`count` seeded lines of pronounceable made-up words: a corpus with enough distinct byte
    pairs to train a BPE vocabulary of thousands of tokens."""
    import random

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "st", "qu"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(count * 8)]
    return [" ".join(words[i : i + 8]) for i in range(0, len(words), 8)]


def build_llama(directory: Path, seed: int = 0, vocab_size: int = 320, **sizes: int) -> Path:
    """Writes config.json, model.safetensors and tokenizer.json into `directory`: the tiny test
    Llama by default; `sizes` override its LlamaConfig sizes (hidden_size, num_hidden_layers, ...)
    and a `vocab_size` over 320 trains the tokenizer on seeded made-up words too (the model's
    vocabulary is the tokenizer's, so every id decodes to text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = CORPUS if vocab_size <= 320 else CORPUS + made_up_words(vocab_size, seed)
    tokenizer.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    shape: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        **sizes,
    }
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.token_to_id("<eos>"),
        bos_token_id=None,
        pad_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.train(False)
    model.save_pretrained(directory)
    return directory


def add_generative(root: Path, name: str, directory: Path, generation: dict[str, object], fmt: str) -> None:
    """`directory`'s files as version 1 of `name` in the repository at `root`, with `[generation]`."""
    version = root / name / "1"
    version.mkdir(parents=True)
    lines = []
    for file in sorted(p for p in directory.iterdir() if p.is_file()):
        shutil.copyfile(file, version / file.name)
        lines.append(f'"{file.name}" = "{file_sha256(file)}"')
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in generation.items())
    head = 'format = "hf"\n\n[hf]\nclass = "AutoModelForCausalLM"\n' if fmt == "hf" else fmt
    text = f"{head}\n{IO}\n[generation]\n{table}\n\n[versions.1.files]\n" + "\n".join(lines) + "\n"
    (root / name / "model.toml").write_text(text)


def repository_with_llama(root: Path, directory: Path) -> ModelRegistry:
    """A repository with the built-ins and `llama-tiny` (hf format, from `directory`)."""
    seed_builtins(root)
    add_generative(root, "llama-tiny", directory, LLAMA_GENERATION, "hf")
    return ModelRegistry(root)


async def start_llama_executor(root: Path, directory: Path, models: tuple[str, ...]) -> RunningExecutor:
    """An executor serving `models` from a repository at `root` with the built-ins and the
    llama-tiny built at `directory`."""
    from services.executor.executor_config import ExecutorConfig
    from services.executor.executor_server import start_executor

    repository_with_llama(root, directory)
    return await start_executor(ExecutorConfig(models=models, model_repository=str(root)))


def text_inputs(
    prompt: str, stream: bool, sampling: dict[str, Any], exclude: bool | None = None
) -> list[Any]:
    """tritonclient inputs of a generation request as Triton's vLLM backend names them: the
    prompt, the stream flag, the sampling parameters (JSON) and, if given,
    `exclude_input_in_output`."""
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = triton.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = triton.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    inputs = [text, flag, params]
    if exclude is not None:
        ex = triton.InferInput("exclude_input_in_output", [1], "BOOL")
        ex.set_data_from_numpy(np.array([exclude], dtype=bool))
        inputs.append(ex)
    return inputs


def token_inputs(prompt: list[int], stream: bool, sampling: dict[str, Any]) -> list[Any]:
    """tritonclient inputs of a generation request given as token ids: `input_ids`, the stream
    flag and the sampling parameters (JSON)."""
    ids = triton.InferInput("input_ids", [len(prompt)], "INT64")
    ids.set_data_from_numpy(np.asarray(prompt, dtype=np.int64))
    flag = triton.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = triton.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    return [ids, flag, params]


def reference_greedy(directory: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """In-process `model.generate` (greedy, cpu eager fp32): the new token ids."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    model.train(False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.eos_token_id,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def tiny_lm_reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of tiny-lm by full forward passes (no cache): the reference."""
    from switchyard.models.registry import load_module

    module = load_module(ModelRegistry.with_builtins().get("tiny-lm"))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(torch.argmax(module(torch.tensor([ids]))[0, -1])))
    return ids[len(prompt) :]


def add_tiny_lm_variant(root: Path, name: str, **generation: object) -> None:
    """tiny-lm-gen's model.toml and weights as `name` (version 1), its [generation] changed."""
    import dataclasses

    from switchyard.models.manifest import read_model_toml, write_model_toml
    from switchyard.models.repository import BUILTIN, CHECKPOINTS

    m = read_model_toml(BUILTIN / "tiny-lm-gen")
    table = {**m.generation_table(), **generation}
    version = m.version("1")
    assert version is not None
    m = dataclasses.replace(m, name=name, generation=tuple(sorted(table.items())), versions=(version,))
    (root / name / "1").mkdir(parents=True)
    shutil.copyfile(CHECKPOINTS / "tiny_lm.safetensors", root / name / "1" / "model.safetensors")
    write_model_toml(root / name, m)
