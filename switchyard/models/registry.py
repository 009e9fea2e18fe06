"""The model registry: reference models and user models, each a fixed checkpoint with sha256.

A model is named by (name, version). Built-in: `mlp`, `tiny-lm`, `minilm-l6`, each at version
"1" (the default) and at version "perturbed": the same checkpoint plus seeded Gaussian noise
(PERTURB_SCALE x each tensor's standard deviation), far outside the DESIGN §4 tolerance, for
shadow and REJECT tests. A user registers a model with a Python factory path
("package.module:function" returning `UserModel`) and a safetensors file.

`load_module` reads the checkpoint, verifies its sha256 against the registry (and against the
hash a caller asked for), and returns the module on CPU in fp32.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from switchyard.errors import FailedPrecondition, InvalidArgument, NotFound
from switchyard.models import minilm, mlp, tiny_lm

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
DEFAULT_VERSION = "1"
PERTURBED_VERSION = "perturbed"
PERTURB_SCALE = 0.05
PERTURB_SEED = 1234

MLP_SHA256 = "4644e1f6a1735cb60afbe0146b4437493cd688f18228eedabe3ee6090d70226c"
TINY_LM_SHA256 = "09cbd2b95a5bad0823859e53148c9f7782a4e7ad7475cfaffb8b1124dd8cec5c"
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


class ModelNotFound(NotFound):
    """Unknown model name or version."""


class CheckpointMismatch(FailedPrecondition):
    """A checkpoint's bytes do not hash to the expected sha256."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. `dims` excludes the batch dimension; -1 = any length up to max_dims."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    max_dims: tuple[int, ...] = ()

    @property
    def floating(self) -> bool:
        return self.datatype in ("FP16", "BF16", "FP32", "FP64")


ExampleInputs = Callable[[int, torch.Generator], list[torch.Tensor]]
TrainLoss = Callable[[nn.Module, int, torch.Generator, torch.dtype, torch.device], torch.Tensor]


@dataclass(frozen=True)
class UserModel:
    """What a user's factory returns: the module (weights loaded later) and its tensors."""

    module: nn.Module
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    factory: Callable[[], nn.Module]
    checkpoint: Callable[[], Path]
    sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    example_inputs: ExampleInputs
    train_loss: TrainLoss | None = None
    convert_state: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    perturb_seed: int | None = None
    description: str = ""
    platform: str = "pytorch_libtorch"


def _committed(name: str) -> Callable[[], Path]:
    return lambda: CHECKPOINTS / name


def builtin_specs() -> list[ModelSpec]:
    base = [
        ModelSpec(
            name="mlp",
            version=DEFAULT_VERSION,
            factory=mlp.build,
            checkpoint=_committed("mlp.safetensors"),
            sha256=MLP_SHA256,
            inputs=(TensorSpec("x", "FP32", (mlp.IN_FEATURES,)),),
            outputs=(TensorSpec("y", "FP32", (mlp.OUT_FEATURES,)),),
            example_inputs=mlp.example_inputs,
            train_loss=mlp.train_loss,
            description="deep narrow residual MLP (96 blocks, width 128), the simple load",
        ),
        ModelSpec(
            name="tiny-lm",
            version=DEFAULT_VERSION,
            factory=tiny_lm.build,
            checkpoint=_committed("tiny_lm.safetensors"),
            sha256=TINY_LM_SHA256,
            inputs=(TensorSpec("input_ids", "INT64", (-1,), (tiny_lm.MAX_SEQ,)),),
            outputs=(TensorSpec("logits", "FP32", (-1, tiny_lm.VOCAB), (tiny_lm.MAX_SEQ, tiny_lm.VOCAB)),),
            example_inputs=tiny_lm.example_inputs,
            train_loss=tiny_lm.train_loss,
            description="decoder-only transformer LM (2 layers, d=128, vocab 512)",
        ),
        ModelSpec(
            name="minilm-l6",
            version=DEFAULT_VERSION,
            factory=minilm.build,
            checkpoint=minilm.checkpoint_path,
            sha256=MINILM_SHA256,
            inputs=(TensorSpec("input_ids", "INT64", (-1,), (minilm.MAX_POS,)),),
            outputs=(TensorSpec("embedding", "FP32", (minilm.HIDDEN,)),),
            example_inputs=minilm.example_inputs,
            convert_state=minilm.convert_state,
            description="all-MiniLM-L6-v2 sentence embeddings (mean-pooled, normalised)",
        ),
    ]
    perturbed = [replace(s, version=PERTURBED_VERSION, perturb_seed=PERTURB_SEED) for s in base]
    return base + perturbed


@dataclass
class ModelRegistry:
    """Specs by (name, version); the default version of a name is "1" or its first registered."""

    specs: dict[tuple[str, str], ModelSpec] = field(default_factory=dict)

    @classmethod
    def with_builtins(cls) -> ModelRegistry:
        registry = cls()
        for spec in builtin_specs():
            registry.add(spec)
        return registry

    def add(self, spec: ModelSpec) -> None:
        self.specs[(spec.name, spec.version)] = spec

    def names(self) -> list[str]:
        return sorted({name for name, _ in self.specs})

    def versions(self, name: str) -> list[str]:
        return sorted(v for n, v in self.specs if n == name)

    def default_version(self, name: str) -> str:
        versions = self.versions(name)
        if not versions:
            raise ModelNotFound(f"unknown model {name!r}; known models: {', '.join(self.names())}")
        return DEFAULT_VERSION if DEFAULT_VERSION in versions else versions[0]

    def get(self, name: str, version: str = "") -> ModelSpec:
        version = version or self.default_version(name)
        spec = self.specs.get((name, version))
        if spec is None:
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; versions: {', '.join(self.versions(name))}"
            )
        return spec

    def register_user(
        self, name: str, version: str, factory_path: str, checkpoint: Path, sha256: str = ""
    ) -> ModelSpec:
        """Registers a user model; the sha256 defaults to the file's current hash."""
        if not name or "/" in name:
            raise InvalidArgument(f"model name {name!r} must be non-empty and contain no '/'")
        build = resolve_factory(factory_path)
        if not checkpoint.is_file():
            raise InvalidArgument(f"checkpoint {checkpoint} is not a file")
        probe = build()
        holder: dict[str, UserModel] = {}

        def factory() -> nn.Module:
            made = build()
            holder["last"] = made
            return made.module

        spec = ModelSpec(
            name=name,
            version=version or DEFAULT_VERSION,
            factory=factory,
            checkpoint=lambda: checkpoint,
            sha256=sha256 or file_sha256(checkpoint),
            inputs=probe.inputs,
            outputs=probe.outputs,
            example_inputs=_examples_from_specs(probe.inputs),
            description=f"user model from {factory_path}",
            platform="pytorch_user",
        )
        self.add(spec)
        return spec


def resolve_factory(path: str) -> Callable[[], UserModel]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise InvalidArgument(f"factory {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"factory {path!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise InvalidArgument(f"factory {path!r} is not callable")

    def checked() -> UserModel:
        made = fn()
        if not isinstance(made, UserModel):
            raise InvalidArgument(f"factory {path!r} must return switchyard.models.registry.UserModel")
        return made

    return checked


def _examples_from_specs(specs: tuple[TensorSpec, ...]) -> ExampleInputs:
    from switchyard.codec import torch_dtype

    def make(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
        out = []
        for s in specs:
            dims = [batch, *(d if d > 0 else 8 for d in s.dims)]
            dtype = torch_dtype(s.datatype)
            if s.floating:
                out.append(torch.randn(dims, generator=generator).to(dtype))
            else:
                out.append(torch.randint(0, 2, dims, generator=generator).to(dtype))
        return out

    return make


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_module(spec: ModelSpec, expected_sha256: str = "") -> nn.Module:
    """Builds the module and loads its verified checkpoint (CPU, fp32, eval mode)."""
    from safetensors.torch import load_file

    path = spec.checkpoint()
    if not path.is_file():
        raise FailedPrecondition(f"checkpoint of {spec.name}:{spec.version} is missing at {path}")
    actual = file_sha256(path)
    for wanted, source in ((spec.sha256, "the registry"), (expected_sha256, "the request")):
        if wanted and actual != wanted:
            raise CheckpointMismatch(
                f"checkpoint {path.name} of {spec.name}:{spec.version} hashes to {actual}, "
                f"but {source} expects {wanted}"
            )
    state = load_file(str(path))
    if spec.convert_state is not None:
        state = spec.convert_state(state)
    module = spec.factory()
    module.load_state_dict(state, strict=True)
    if spec.perturb_seed is not None:
        perturb(module, spec.perturb_seed)
    return module.eval()


def perturb(module: nn.Module, seed: int, scale: float = PERTURB_SCALE) -> None:
    """Adds seeded noise of `scale` x each parameter's std (deterministic across processes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            std = float(param.float().std()) if param.numel() > 1 else 1.0
            noise = torch.randn(param.shape, generator=generator) * (scale * (std or 1.0))
            param.add_(noise.to(param.dtype))
