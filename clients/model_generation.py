"""Generative models in `switchyard models add|validate`: the declaration and the check.

A Hugging Face causal LM of the Llama family with a `tokenizer.json` becomes a generative
entry: the tensors Triton's vLLM backend names (`text_input`, `stream`,
`sampling_parameters`, ... and the token ids both ways) and a `[generation]` table filled from
the model's own limits (`max_position_embeddings`). Its validation is no tensor run (a BYTES
prompt has no example tensor) but a short greedy generation through the executor's engine,
on the backend asked, checked token for token against the model's own decoding:
transformers' `generate()` for a Hugging Face model, full forward passes for a factory one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from switchyard.errors import InvalidArgument
from switchyard.models.generation import MAX_GRAPHS_PER_KIND, GenerationSettings
from switchyard.models.manifest import HFEntry, ModelToml, TensorSpec
from switchyard.models.repository import ModelSpec, load_module

PROMPT = "the quick brown fox"
CHECK_TOKENS = 8
MAX_CONTEXT = 2048  # the default KV cache length when the model allows more
DECODE_SLOTS = 8
LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # services/executor/generation/models.py serves these


@dataclass(frozen=True)
class GenerationCheck:
    """What a generative validation ran and saw."""

    backend: str
    mode: str
    prompt_tokens: int
    tokens: tuple[int, ...]
    reference: tuple[int, ...]
    text: str
    reference_name: str
    load_s: float

    @property
    def agrees(self) -> bool:
        return self.tokens == self.reference


def is_generative_folder(source: Path, config: dict[str, Any]) -> bool:
    """A Llama-family causal LM with a tokenizer.json: what `models add` makes generative."""
    arch = (config.get("architectures") or [""])[0]
    return (
        arch.endswith("ForCausalLM")
        and config.get("model_type") in LLAMA_FAMILY
        and (source / "tokenizer.json").is_file()
    )


@dataclass(frozen=True)
class GenerationSizes:
    """What `models add`'s options ask of `[generation]`; 0 or () leaves a value to the model's
    config. vLLM's names in brackets: `max_context` (--max-model-len), `decode_slots`
    (--max-num-seqs)."""

    max_context: int = 0
    max_new_tokens: int = 0
    prompt_buckets: tuple[int, ...] = ()
    decode_slots: int = 0
    decode_buckets: tuple[int, ...] = ()

    @property
    def given(self) -> list[str]:
        """The options set, as typed: for a message that refuses them."""
        return [f"--{k.replace('_', '-')}" for k, v in vars(self).items() if v]


def generation_table(config: dict[str, Any], sizes: GenerationSizes = GenerationSizes()) -> dict[str, Any]:
    """`[generation]` from the model's limits and `sizes`: by default the context it was trained
    for (at most MAX_CONTEXT), half of it for new tokens, prompt buckets of powers of two up to
    the rest, DECODE_SLOTS slots. INVALID_ARGUMENT names the option to fix."""
    limit = int(config.get("max_position_embeddings") or 0)
    if limit < 4:
        raise InvalidArgument(
            f"config.json's max_position_embeddings is {limit}; a generative model needs 4 or more"
        )
    context = sizes.max_context or min(limit, MAX_CONTEXT)
    if not 4 <= context <= limit:
        raise InvalidArgument(
            f"--max-context {context} must be 4 to the model's max_position_embeddings ({limit}, "
            "config.json): the model has no positions past it"
        )
    prompt = _prompt_buckets(sizes.prompt_buckets, context) if sizes.prompt_buckets else []
    new_tokens = sizes.max_new_tokens or (context - prompt[-1] if prompt else context // 2)
    if not 1 <= new_tokens < context:
        raise InvalidArgument(f"--max-new-tokens {new_tokens} must be 1 to max context - 1 ({context - 1})")
    table: dict[str, Any] = {
        "max_context": context,
        "max_new_tokens": new_tokens,
        "prompt_buckets": prompt or _powers_of_two(context - new_tokens),
        "decode_slots": sizes.decode_slots or (sizes.decode_buckets or (DECODE_SLOTS,))[-1],
    }
    if sizes.decode_buckets:
        table["decode_buckets"] = _decode_buckets(sizes.decode_buckets, table["decode_slots"])
    try:
        GenerationSettings.from_table(table)  # what else the engine refuses, refused before any copy
    except InvalidArgument as exc:
        raise InvalidArgument(f"these sizes make a [generation] table the engine refuses: {exc}") from None
    return table


def _increasing(option: str, values: tuple[int, ...]) -> list[int]:
    if values[0] < 1 or any(b <= a for a, b in pairwise(values)):
        raise InvalidArgument(
            f"{option} {','.join(map(str, values))} must be increasing positive sizes, e.g. 16,32"
        )
    if len(values) > MAX_GRAPHS_PER_KIND:
        raise InvalidArgument(
            f"{option} has {len(values)} sizes; at most {MAX_GRAPHS_PER_KIND} (each is a graph to compile)"
        )
    return list(values)


def _prompt_buckets(given: tuple[int, ...], context: int) -> list[int]:
    if given[-1] >= context:
        raise InvalidArgument(
            f"--prompt-buckets: the largest, {given[-1]}, must be under the max context ({context}) "
            "to leave room for a generated token"
        )
    return _increasing("--prompt-buckets", given)


def _powers_of_two(room: int) -> list[int]:
    """The default prompt buckets: powers of two from 8 below `room`, then `room`."""
    buckets: list[int] = []
    size = 8
    while size < room:
        buckets.append(size)
        size *= 2
    return [*buckets, room][-MAX_GRAPHS_PER_KIND:]


def _decode_buckets(given: tuple[int, ...], slots: int) -> list[int]:
    buckets = _increasing("--decode-buckets", given)
    if buckets[-1] != slots:
        raise InvalidArgument(
            f"--decode-buckets must end at --decode-slots ({slots}): the widest decode step runs every "
            f"slot; got {','.join(map(str, buckets))}"
        )
    return buckets


def generative_declaration(
    source: Path, name: str, config: dict[str, Any], sizes: GenerationSizes = GenerationSizes()
) -> ModelToml:
    """The model.toml of a generative Hugging Face folder (its tokenizer.json is the tokenizer)."""
    if not (source / "tokenizer.json").is_file():
        raise InvalidArgument(
            f"{source} has no tokenizer.json; a generative model needs one (save it with "
            "tokenizer.save_pretrained, or drop --generation)"
        )
    if config.get("model_type") not in LLAMA_FAMILY:
        raise InvalidArgument(
            f"generation serves Hugging Face causal LMs of type {', '.join(LLAMA_FAMILY)}; "
            f"{source}/config.json says model_type {config.get('model_type')!r}"
        )
    table = generation_table(config, sizes)
    inputs = (
        TensorSpec("text_input", "BYTES", (1,)),
        TensorSpec("stream", "BOOL", (1,)),
        TensorSpec("sampling_parameters", "BYTES", (1,)),
        TensorSpec("exclude_input_in_output", "BOOL", (1,)),
        TensorSpec("input_ids", "INT64", (-1,), (table["prompt_buckets"][-1],)),
    )
    outputs = (
        TensorSpec("text_output", "BYTES", (-1,)),
        TensorSpec("output_ids", "INT64", (-1,), (table["max_new_tokens"],)),
    )
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    return ModelToml(
        name,
        "hf",
        inputs,
        outputs,
        (),
        hf=HFEntry(model_class=arch),
        description=f"{arch} served by the generation engine (context {table['max_context']})",
        generation=tuple(sorted(table.items())),
    )


def read_config(source: Path) -> dict[str, Any]:
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{source}/config.json cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{source}/config.json is not a JSON object")
    return config


def validate_generation(
    spec: ModelSpec, backend_name: str = "cpu", mode: str = "", tokens: int = CHECK_TOKENS
) -> GenerationCheck:
    """Loads `spec` on the backend as the executor does, generates greedily from PROMPT and
    compares the token ids with the model's own greedy decoding on the CPU (fp32)."""
    from services.executor.device import select_backend
    from services.executor.generation.engine import EngineCore
    from services.executor.generation.engine_messages import Admitted
    from services.executor.generation.runtime import load_runtime
    from services.executor.generation.scheduler import admit, split
    from services.executor.generation.settings import SamplingParams
    from services.executor.generation.tokenizer import load_tokenizer
    from services.executor.load_phases import LoadOptions

    backend = select_backend(backend_name, 0)
    options = LoadOptions(
        mode=mode or backend.modes[0],
        precision="fp32",
        batch_buckets=(1,),
        max_queue_delay_us=0,
        max_queue_size=8,
        dynamic_batching=False,
    )
    runtime, times, _ = load_runtime(spec, backend, options)
    settings = runtime.settings
    tokenizer = load_tokenizer(settings.tokenizer, spec.folder)
    prompt = tokenizer.encode(PROMPT)[: settings.max_prompt]
    tokens = min(tokens, settings.max_new_tokens)
    engine = EngineCore(runtime, tokenizer)
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    limit = admit(settings, runtime.vocab_size, prompt, params, 0)
    request = engine.add(Admitted(prompt, params, limit, True, None))
    while engine.busy:
        engine.iterate()
    events, error = split(request.events.take())
    if error is not None:
        raise error
    got = tuple(t for e in events for t in e.token_ids)
    reference, how = _reference(spec, prompt, tokens, tuple(runtime.eos_token_ids))
    return GenerationCheck(
        backend.name,
        options.mode,
        len(prompt),
        got,
        reference,
        "".join(e.text for e in events),
        how,
        times.total_s,
    )


def _reference(
    spec: ModelSpec, prompt: list[int], tokens: int, eos: tuple[int, ...]
) -> tuple[tuple[int, ...], str]:
    """The model's own greedy decoding on the CPU in fp32: (new token ids, what produced them)."""
    module = load_module(spec)
    module.train(False)
    ids = torch.tensor([prompt])
    hf = getattr(module, "model", module)  # the hf format wraps the transformers model
    with torch.no_grad():
        generate = getattr(hf, "generate", None)
        if callable(generate) and getattr(hf, "config", None) is not None:
            out = generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=tokens,
                eos_token_id=list(eos) or None,
                pad_token_id=eos[0] if eos else 0,
            )
            return tuple(int(t) for t in out[0, len(prompt) :]), "transformers generate()"
        seq = list(prompt)
        for _ in range(tokens):
            logits = module(torch.tensor([seq]))
            logits = logits[0] if isinstance(logits, tuple | list) else logits
            seq.append(int(torch.argmax(logits[0, -1])))
            if seq[-1] in eos:
                break
        return tuple(seq[len(prompt) :]), "full forward passes"
