"""Adding and removing repository models (`switchyard models add|remove`), and validation.

`add_model` copies an artifact into `<repo>/<name>/<version>/`, hashes every file, writes or
completes `model.toml`, and validates by loading on the CPU and running the declared inputs;
only then does the version appear (staged in a hidden folder, renamed into place), so a failed
add leaves nothing half-written. Every add and remove is appended to `<repo>/audit.jsonl`
(the CLI also sends it to metering's audit log when a cluster is reachable).
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from switchyard.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from switchyard.models import formats
from switchyard.models.manifest import (
    FORMATS,
    NAME,
    ExportEntry,
    HFEntry,
    ModelToml,
    TensorSpec,
    Version,
    file_sha256,
    read_model_toml,
    write_model_toml,
)
from switchyard.models.repository import ModelSpec, Repository, load_module

if TYPE_CHECKING:
    from clients.model_generation import GenerationSizes

AUDIT_FILE = "audit.jsonl"


@dataclass(frozen=True)
class Validation:
    """What validation ran: per output, the shape it returned for the example batch."""

    batch: int
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    output_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    generated: str | None = None  # a generative model's greedy text (it equals the reference's)


def detect_format(source: Path) -> str:
    if source.is_file():
        if source.suffix == ".pt2":
            return "torch_export"
        raise InvalidArgument(
            f"{source} is a single {source.suffix or 'extensionless'} file; give --format, or a folder "
            "with model.toml (factory), config.json (hf) or a .pt2 program (torch_export)"
        )
    if not source.is_dir():
        raise InvalidArgument(f"{source} does not exist; give a file or folder to add")
    if (source / "model.toml").is_file():
        return read_model_toml(source, partial=True, name=source.name).format
    if (source / "config.json").is_file():
        return "hf"
    if list(source.glob("*.pt2")):
        return "torch_export"
    raise InvalidArgument(
        f"cannot tell the format of {source}: it has no model.toml, config.json or .pt2; give --format"
    )


def _hf_defaults(
    source: Path, name: str, generation: bool | None = None, sizes: GenerationSizes | None = None
) -> ModelToml:
    """I/O of a transformers directory from its config.json: a Llama-family causal LM with a
    tokenizer.json is generative (`model_generation`, its `[generation]` sized by `sizes`;
    `generation` True or False overrides); encoders take input_ids and attention_mask; a
    *ForCausalLM returns logits per position, a *ForSequenceClassification logits per label,
    anything else last_hidden_state."""
    from clients import model_generation

    config = model_generation.read_config(source)
    if generation is None:
        generation = model_generation.is_generative_folder(source, config)
    if generation:
        return model_generation.generative_declaration(
            source, name, config, sizes or model_generation.GenerationSizes()
        )
    _refuse_sizes(
        ", ".join(sizes.given if sizes else ()),
        f"{source} is not generative (a Llama-family *ForCausalLM with a tokenizer.json, or --generation)",
    )
    arch = (config.get("architectures") or ["AutoModel"])[0]
    vocab = int(config.get("vocab_size", 2))
    max_pos = int(config.get("max_position_embeddings", 512))
    ids = TensorSpec("input_ids", "INT64", (-1,), (max_pos,), (0.0, float(vocab)))
    mask = TensorSpec("attention_mask", "INT64", (-1,), (max_pos,), (1.0, 2.0))
    if arch.endswith("ForCausalLM"):
        inputs: tuple[TensorSpec, ...] = (ids,)
        outputs = (TensorSpec("logits", "FP32", (-1, vocab), (max_pos, vocab)),)
    elif arch.endswith("ForSequenceClassification"):
        labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
        inputs, outputs = (ids, mask), (TensorSpec("logits", "FP32", (labels,)),)
    else:
        hidden = int(config.get("hidden_size", config.get("d_model", 1)))
        inputs = (ids, mask)
        outputs = (TensorSpec("last_hidden_state", "FP32", (-1, hidden), (max_pos, hidden)),)
    return ModelToml(name, "hf", inputs, outputs, (), hf=HFEntry(model_class=arch))


def _export_defaults(source: Path, name: str, file: str) -> ModelToml:
    """I/O of an ExportedProgram from its graph: placeholder names and example shapes, with
    symbolic (dynamic) dimensions as -1."""
    from switchyard.codec import oip_datatype

    try:
        program = torch.export.load(str(source / file))
    except Exception as exc:
        raise FailedPrecondition(
            f"torch.export.load cannot load {file}: {type(exc).__name__}: {exc}"
        ) from None
    sig = program.graph_signature
    user_inputs = set(sig.user_inputs)
    nodes = {n.name: n for n in program.graph.nodes}

    def spec(tensor_name: str, node_name: str) -> TensorSpec:
        val = nodes[node_name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InvalidArgument(f"{file}: {node_name} is not a tensor; only tensor inputs/outputs serve")
        dims = tuple(d if isinstance(d, int) else -1 for d in val.shape[1:])
        return TensorSpec(tensor_name, oip_datatype(val.dtype), dims)

    placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    inputs = tuple(spec(n, n) for n in placeholders)
    outputs = tuple(spec(f"output{i}", str(o)) for i, o in enumerate(sig.user_outputs))
    return ModelToml(name, "torch_export", inputs, outputs, (), torch_export=ExportEntry(file))


def _artifact_files(source: Path, fmt: str) -> list[tuple[Path, str]]:
    """(file, path inside the version folder) to copy."""
    if source.is_file():
        return [(source, "model.pt2" if fmt == "torch_export" else source.name)]
    out = []
    for p in sorted(source.rglob("*")):
        rel = p.relative_to(source)
        if p.is_file() and str(rel) != "model.toml" and not any(part.startswith(".") for part in rel.parts):
            out.append((p, str(rel)))
    if not out:
        raise InvalidArgument(f"{source} holds no artifact files")
    return out


IO = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]


def _complete(base: ModelToml, io: IO | None) -> ModelToml:
    if io is None or (base.inputs and base.outputs):
        return base
    ins, outs = io
    return dataclasses.replace(base, inputs=base.inputs or ins, outputs=base.outputs or outs)


def _factory_io(m: ModelToml, allowed: Sequence[str]) -> IO | None:
    from switchyard.models.registry import UserModel

    if m.factory is None or (m.inputs and m.outputs):
        return None
    made = formats.resolve(m.factory.function, allowed, "factory")()
    if not isinstance(made, UserModel):
        raise InvalidArgument(
            f"model.toml of {m.name} declares no inputs/outputs and factory {m.factory.function!r} "
            "returns a bare module; declare [[inputs]] and [[outputs]] or return UserModel"
        )
    return made.inputs, made.outputs


def validate(spec: ModelSpec, batch: int = 2) -> Validation:
    """Loads on the CPU and runs seeded example inputs; the outputs must match the declared
    count, datatypes and dims (INVALID_ARGUMENT naming both shapes otherwise). A generative
    model generates greedily instead, and must agree with its own decoding."""
    if spec.generation is not None:
        return _validate_generation(spec)
    module = load_module(spec)
    inputs = spec.example_inputs(batch, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        result = module(*inputs)
    outs = list(result) if isinstance(result, tuple | list) else [result]
    shapes = check_outputs(spec, outs, batch)
    in_shapes = tuple((s.name, tuple(t.shape)) for s, t in zip(spec.inputs, inputs, strict=True))
    return Validation(batch, in_shapes, shapes)


def _validate_generation(spec: ModelSpec) -> Validation:
    from clients.model_generation import validate_generation

    check = validate_generation(spec)
    if not check.agrees:
        raise InvalidArgument(
            f"{spec.name} generates {list(check.tokens)} greedily on {check.backend}, but its "
            f"{check.reference_name} gives {list(check.reference)}; the model does not serve as it decodes"
        )
    return Validation(
        1,
        (("input_ids", (1, check.prompt_tokens)),),
        (("output_ids", (1, len(check.tokens))),),
        generated=check.text,
    )


def check_outputs(
    spec: ModelSpec, outs: Sequence[Any], batch: int, dtypes: bool = True
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The outputs a model returned for `batch` rows against model.toml (INVALID_ARGUMENT
    naming both shapes when they disagree)."""
    from switchyard.codec import oip_datatype

    declared = spec.outputs
    if len(outs) != len(declared):
        raise InvalidArgument(
            f"{spec.name} returns {len(outs)} output(s) but model.toml declares {len(declared)} "
            f"({[s.name for s in declared]}); make them agree"
        )
    shapes = []
    for s, out in zip(declared, outs, strict=True):
        if not isinstance(out, torch.Tensor):
            raise InvalidArgument(f"{spec.name} output {s.name!r} is a {type(out).__name__}, not a tensor")
        got = tuple(out.shape)
        want = (batch, *s.dims)
        fits = len(got) == len(want) and all(w == -1 or g == w for g, w in zip(got, want, strict=True))
        if not fits:
            raise InvalidArgument(
                f"{spec.name} output {s.name!r} has shape {list(got)} for a batch of {batch}, but model.toml "
                f"declares [batch, {', '.join(map(str, s.dims))}] = {list(want)}; fix model.toml's dims"
            )
        if dtypes and oip_datatype(out.dtype) != s.datatype:
            raise InvalidArgument(
                f"{spec.name} output {s.name!r} is {oip_datatype(out.dtype)}, "
                f"but model.toml declares {s.datatype}"
            )
        shapes.append((s.name, got))
    return tuple(shapes)


def audit(root: Path, action: str, detail: dict[str, Any]) -> dict[str, Any]:
    """Appends one line to <repo>/audit.jsonl and returns it."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"at": at, "action": action, "by": _user(), **detail}
    with (root / AUDIT_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return record


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _next_version(existing: ModelToml | None) -> str:
    if existing is None:
        return "1"
    numbers = [int(v.name) for v in existing.versions if v.name.isdigit()]
    return str(max(numbers, default=0) + 1)


def _check_names(name: str, version: str, fmt: str) -> None:
    if not NAME.match(name):
        raise InvalidArgument(f"model name {name!r} must be 1-63 letters, digits, '.', '_' or '-'")
    if version and not NAME.match(version):
        raise InvalidArgument(f"version {version!r} must be letters, digits, '.', '_' or '-'")
    if fmt and fmt not in FORMATS:
        raise InvalidArgument(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def _declaration(
    source: Path,
    name: str,
    fmt: str,
    existing: ModelToml | None,
    generation: bool | None = None,
    sizes: GenerationSizes | None = None,
) -> ModelToml:
    """The model-level declaration: the source's model.toml, else the repository's, else inferred
    (`sizes` size an inferred `[generation]`; a declaration read from a model.toml keeps its own)."""
    given = ", ".join(sizes.given) if sizes is not None else ""
    if source.is_dir() and (source / "model.toml").is_file():
        _refuse_sizes(given, f"{source}/model.toml declares this model; set its [generation] there")
        base = dataclasses.replace(read_model_toml(source, partial=True, name=name), name=name)
    elif existing is not None:
        _refuse_sizes(given, f"{name} is in the repository already; edit [generation] in its model.toml")
        base = existing
    elif fmt == "hf":
        base = _hf_defaults(source, name, generation, sizes)
    elif fmt == "torch_export":
        if source.is_file():  # copied in as model.pt2
            base = _export_defaults(source.parent, name, source.name)
            base = dataclasses.replace(base, torch_export=ExportEntry("model.pt2"))
        else:
            base = _export_defaults(source, name, sorted(p.name for p in source.glob("*.pt2"))[0])
    else:
        raise InvalidArgument(
            f"a factory model needs a folder with model.toml ([factory] function = 'pkg.mod:fn') and its "
            f"weights; {source} has no model.toml"
        )
    if base.format != fmt:
        raise InvalidArgument(f"{source}/model.toml says format {base.format!r}, but --format is {fmt!r}")
    if fmt != "hf":
        _refuse_sizes(given, f"a {fmt} model is not generative")
    return base


def _refuse_sizes(given: str, why: str) -> None:
    """The [generation] options size the table `add` infers from a Hugging Face folder only."""
    if given:
        raise InvalidArgument(f"{given}: {why} (these options size the [generation] table of a new model)")


def _stage_and_commit(
    root: Path,
    name: str,
    source: Path,
    version: str,
    base: ModelToml,
    existing: ModelToml | None,
    allowed_factories: Sequence[str],
) -> Validation:
    """Copy and hash the artifact into a hidden staging folder, validate it, then move it in:
    the version folder by rename, then model.toml (a reader sees old or new, never half)."""
    folder = root / name
    staging = Path(tempfile.mkdtemp(prefix=f".add-{name}-", dir=root))
    try:
        staged = staging / version
        staged.mkdir()
        files = []
        for src, rel in _artifact_files(source, base.format):
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, staged / rel)
            files.append((rel, file_sha256(staged / rel)))
        new_version = Version(version, tuple(sorted(files)), description="")
        others = tuple(v for v in (existing.versions if existing else ()) if v.name != version)
        manifest = dataclasses.replace(base, versions=(*others, new_version))
        result = validate(ModelSpec(name, version, manifest, staged, tuple(allowed_factories)))
        folder.mkdir(exist_ok=True)
        target = folder / version
        if target.exists():
            shutil.move(str(target), str(staging / "replaced"))
        staged.rename(target)
        write_model_toml(folder, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def add_model(
    root: Path,
    name: str,
    source: Path,
    version: str = "",
    fmt: str = "",
    replace: bool = False,
    allowed_factories: Sequence[str] = (),
    description: str = "",
    generation: bool | None = None,
    sizes: GenerationSizes | None = None,
) -> tuple[ModelSpec, Validation]:
    """Adds `source` as `name:version`; returns the spec and what validation ran. `generation`
    None infers a generative model from a Hugging Face folder, True or False says it; `sizes`
    size its `[generation]` table (`model_generation.generation_table`)."""
    _check_names(name, version, fmt)
    source = source.resolve()
    fmt = fmt or detect_format(source)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / name
    existing = read_model_toml(folder) if (folder / "model.toml").is_file() else None
    version = version or _next_version(existing)
    replaced = existing is not None and existing.version(version) is not None
    if replaced and not replace:
        raise AlreadyExists(
            f"{name}:{version} already exists in {root}; pass --replace to overwrite it, or another --version"
        )
    if existing is not None and existing.format != fmt:
        raise InvalidArgument(
            f"{name} is a {existing.format} model; a new version must be {existing.format} too"
        )
    if generation and fmt != "hf":
        raise InvalidArgument(f"--generation makes a Hugging Face folder generative; {source} is {fmt}")
    base = _declaration(source, name, fmt, existing, generation, sizes)
    if description:
        base = dataclasses.replace(base, description=description)
    base = _complete(base, _factory_io(base, allowed_factories))
    if not base.inputs or not base.outputs:
        raise InvalidArgument(f"{name}: model.toml must declare [[inputs]] and [[outputs]]")
    result = _stage_and_commit(root, name, source, version, base, existing, allowed_factories)
    final = Repository(root, tuple(allowed_factories)).get(name, version)
    detail = {"model": name, "version": version, "format": fmt, "sha256": final.sha256, "replaced": replaced}
    audit(root, "model.add", detail)
    return final, result


def remove_model(root: Path, name: str, version: str = "") -> list[str]:
    """Removes one version (or the whole model when version is ""); returns what went."""
    repo = Repository(root)
    manifest = repo.manifest(name)
    if version:
        if manifest.version(version) is None:
            repo.get(name, version)  # NOT_FOUND naming the versions
        rest = tuple(v for v in manifest.versions if v.name != version)
        if rest:
            default = manifest.default_version if manifest.default_version != version else ""
            write_model_toml(
                root / name, dataclasses.replace(manifest, versions=rest, default_version=default)
            )
            shutil.rmtree(root / name / version, ignore_errors=True)
            audit(root, "model.remove", {"model": name, "version": version})
            return [version]
    removed = [v.name for v in manifest.versions]
    trash = Path(tempfile.mkdtemp(prefix=f".remove-{name}-", dir=root))
    (root / name).rename(trash / name)
    shutil.rmtree(trash, ignore_errors=True)
    audit(root, "model.remove", {"model": name, "versions": removed})
    return removed
