"""Loading a repository model's artifact, one function per format, by the libraries' own code.

- `hf`: transformers `from_pretrained` (offline, `trust_remote_code` never set) of the class
  model.toml names, wrapped so positional tensors in declared input order become keyword
  arguments and the declared outputs are read off the model output by name.
- `torch_export`: `torch.export.load` of a `.pt2` ExportedProgram; no user Python code runs.
- `factory`: a `package.module:function` from an allowed package builds the module, whose
  safetensors weights are then loaded strictly.

Every loader returns an `nn.Module` on the CPU in fp32, in eval mode. Hashes are checked by the
caller (`switchyard.models.repository`) before any loader touches a file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from switchyard.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from switchyard.models.manifest import ModelToml, TensorSpec

# The project's own reference models may always be built; anything else needs the operator's
# allow-list ([executors] allowed_factories), because a factory is code the executor runs.
BUILTIN_FACTORY_MODULES = ("switchyard.models.mlp", "switchyard.models.tiny_lm", "switchyard.models.minilm")


class FormatUnavailable(FailedPrecondition):
    """The artifact cannot be loaded here (the library refused it); the message has its reason."""


@dataclass(frozen=True)
class UserModel:
    """What a user's factory may return: the module (weights loaded later) and its tensors.

    Defined with the factory format that reads it; `switchyard.models.registry` gives it to
    users under the name the docs show."""

    module: nn.Module
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def _allowed(module: str, allowed: Sequence[str]) -> bool:
    if module in BUILTIN_FACTORY_MODULES:
        return True
    return any(module == pkg or module.startswith(pkg + ".") for pkg in allowed if pkg)


def resolve(path: str, allowed: Sequence[str], what: str) -> Callable[..., Any]:
    """Imports `package.module:function` if its package is allowed; PERMISSION_DENIED otherwise.

    The check happens before the import, so a refused path never runs module-level code."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise InvalidArgument(f"{what} {path!r} must look like 'package.module:function'")
    if not _allowed(module_name, allowed):
        raise PermissionDenied(
            f"{what} {path!r} is not in an allowed package ({', '.join(allowed) or 'none allowed'}); "
            f"an operator adds its package to [executors] allowed_factories (or --allow-factory)"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise FailedPrecondition(f"{what} {path!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise FailedPrecondition(f"{what} {path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def load_factory(m: ModelToml, folder: Path, allowed: Sequence[str]) -> nn.Module:
    from safetensors.torch import load_file

    assert m.factory is not None
    made = resolve(m.factory.function, allowed, "factory")()
    module = made.module if isinstance(made, UserModel) else made
    if not isinstance(module, nn.Module):
        raise FailedPrecondition(
            f"factory {m.factory.function!r} must return an nn.Module or "
            f"switchyard.models.registry.UserModel, got {type(made).__name__}"
        )
    state = load_file(str(folder / m.factory.weights))
    if m.factory.convert_state:
        state = resolve(m.factory.convert_state, allowed, "convert_state")(state)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise FailedPrecondition(f"weights of {m.name} do not fit the factory's module: {exc}") from None
    return module


class HFModule(nn.Module):
    """A transformers model called with declared inputs (positional) returning declared outputs."""

    def __init__(self, model: nn.Module, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(inputs)
        self.output_names = tuple(outputs)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.input_names, tensors, strict=True)), return_dict=True)
        return tuple(out[name] for name in self.output_names)


def load_hf(m: ModelToml, folder: Path) -> nn.Module:
    assert m.hf is not None
    try:
        import transformers
    except ImportError as exc:
        raise FormatUnavailable(f"format hf needs transformers in this environment: {exc}") from None
    cls = getattr(transformers, m.hf.model_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise FailedPrecondition(
            f"model.toml of {m.name}: hf.class {m.hf.model_class!r} is not a transformers model class "
            f"(transformers {transformers.__version__})"
        )
    try:
        model = cls.from_pretrained(
            str(folder),
            local_files_only=True,
            trust_remote_code=False,
            dtype=torch.float32,
            attn_implementation=m.hf.attn_implementation,
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise FormatUnavailable(f"transformers cannot load {m.name} from {folder.name}: {exc}") from None
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False  # one forward pass per request: no KV cache to return
    outputs = m.hf.outputs or tuple(s.name for s in m.outputs)
    return HFModule(model, [s.name for s in m.inputs], outputs)


def load_export(m: ModelToml, folder: Path) -> nn.Module:
    assert m.torch_export is not None
    path = folder / m.torch_export.file
    try:
        program = torch.export.load(str(path))
    except Exception as exc:  # the library's reason, whatever it raises (version, format, ...)
        raise FormatUnavailable(
            f"torch.export.load cannot load {m.name}'s {path.name} with torch {torch.__version__}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return program.module()


def load(m: ModelToml, folder: Path, allowed: Sequence[str]) -> nn.Module:
    if m.format == "factory":
        module = load_factory(m, folder, allowed)
    elif m.format == "hf":
        module = load_hf(m, folder)
    else:
        module = load_export(m, folder)
    if m.format != "torch_export":  # an exported program's module has no train/eval switch
        module = module.eval()
    return module


Examples = Callable[[int, torch.Generator], list[torch.Tensor]]


def example_maker(m: ModelToml, allowed: Sequence[str]) -> Examples:
    if m.factory is not None and m.factory.examples:
        return resolve(m.factory.examples, allowed, "examples")
    return examples_from_specs(m.inputs)


def examples_from_specs(specs: Sequence[TensorSpec]) -> Examples:
    """Seeded example tensors from declared inputs: -1 dims take min(8, max_dims)."""
    from switchyard.codec import torch_dtype

    def make(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
        out = []
        for s in specs:
            dims = [batch]
            for i, d in enumerate(s.dims):
                dims.append(d if d > 0 else min(8, s.max_dims[i]) if s.max_dims else 8)
            dtype = torch_dtype(s.datatype)
            if s.floating:
                mean, std = s.example_range or (0.0, 1.0)
                out.append((torch.randn(dims, generator=generator) * std + mean).to(dtype))
            else:
                low, high = s.example_range or (0.0, 2.0)
                out.append(torch.randint(int(low), int(high), dims, generator=generator).to(dtype))
        return out

    return make
