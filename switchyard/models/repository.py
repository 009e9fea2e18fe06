"""The model repository: the one way models enter switchyard.

`<repo>/<model>/model.toml` declares the model (switchyard.models.manifest); each version is a
folder `<repo>/<model>/<version>/` holding the artifact files whose sha256s model.toml lists.
`Repository.get(name, version)` reads model.toml afresh (a model added while an executor runs
is loadable at once) and `load_module` checks every file's hash before a loader opens it.

The built-ins (`mlp`, `tiny-lm`, `minilm-l6`, and `tiny-lm-gen`: tiny-lm's weights served by
the generation engine; each at version "1" and at "perturbed": the same
weights plus seeded noise, for shadow and REJECT tests) are factory-format entries shipped in
`switchyard/models/builtin/<name>/model.toml`; `seed_builtins(repo)` copies them with their
weights into a repository (`switchyard up` seeds `var/models`; in-process executors without a
repository use `default_repository()`, a seeded folder in the user's cache).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from switchyard.errors import FailedPrecondition, NotFound
from switchyard.models import formats
from switchyard.models.builtins import BUILTIN as BUILTIN
from switchyard.models.builtins import BUILTIN_NAMES as BUILTIN_NAMES
from switchyard.models.builtins import CHECKPOINTS as CHECKPOINTS
from switchyard.models.builtins import CheckpointMismatch as CheckpointMismatch
from switchyard.models.builtins import seed_builtins as seed_builtins
from switchyard.models.generation import GenerationSettings
from switchyard.models.manifest import (
    NAME,
    ManifestError,
    ModelToml,
    TensorSpec,
    Version,
    file_sha256,
    read_model_toml,
)

DEFAULT_VERSION = "1"
PERTURBED_VERSION = "perturbed"
PERTURB_SCALE = 0.05
PERTURB_SEED = 1234

ExampleInputs = Callable[[int, torch.Generator], list[torch.Tensor]]
TrainLoss = Callable[[nn.Module, int, torch.Generator, torch.dtype, torch.device], torch.Tensor]


class ModelNotFound(NotFound):
    """Unknown model name or version."""


@dataclass(frozen=True)
class ModelSpec:
    """One loadable (model, version) of a repository."""

    name: str
    version: str
    manifest: ModelToml
    folder: Path  # the version folder
    allowed_factories: tuple[str, ...] = ()

    @property
    def sha256(self) -> str:
        return self._version.sha256

    @property
    def _version(self) -> Version:
        version = self.manifest.version(self.version)
        assert version is not None
        return version

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.outputs

    @property
    def platform(self) -> str:
        return self.manifest.platform

    @property
    def description(self) -> str:
        return self._version.description or self.manifest.description

    @property
    def example_inputs(self) -> ExampleInputs:
        return formats.example_maker(self.manifest, self.allowed_factories)

    @property
    def generation(self) -> GenerationSettings | None:
        """The `[generation]` table: this model is a causal LM served by the generation engine."""
        table = self.manifest.generation_table()
        return GenerationSettings.from_table(table) if table else None

    @property
    def train_loss(self) -> TrainLoss | None:
        f = self.manifest.factory
        if f is None or not f.train_loss:
            return None
        return formats.resolve(f.train_loss, self.allowed_factories, "train_loss")


def verify_files(spec: ModelSpec, expected_sha256: str = "") -> None:
    """Every listed file exists and hashes as model.toml says; no unlisted file is present."""
    version, where = spec._version, f"{spec.name}:{spec.version}"
    if not spec.folder.is_dir():
        raise FailedPrecondition(f"version folder of {where} is missing at {spec.folder}")
    listed = {path for path, _ in version.files}
    present = {str(p.relative_to(spec.folder)) for p in spec.folder.rglob("*") if p.is_file()}
    unlisted = sorted(present - listed)
    if unlisted:
        raise CheckpointMismatch(
            f"{where} has file(s) {unlisted[:3]} that model.toml does not list; remove them or "
            f"re-add the version with `switchyard models add --replace`"
        )
    for path, wanted in version.files:
        file = spec.folder / path
        if not file.is_file():
            raise FailedPrecondition(f"artifact file {path} of {where} is missing at {file}")
        actual = file_sha256(file)
        if actual != wanted:
            raise CheckpointMismatch(
                f"artifact {path} of {where} hashes to {actual}, but model.toml expects {wanted}; "
                f"restore the file or re-add the version with `switchyard models add --replace`"
            )
    if expected_sha256 and spec.sha256 != expected_sha256:
        raise CheckpointMismatch(
            f"{where} has artifact sha256 {spec.sha256}, but the request expects {expected_sha256}"
        )


def load_module(spec: ModelSpec, expected_sha256: str = "") -> nn.Module:
    """Verifies the artifact, then builds the module (CPU, fp32, eval mode)."""
    verify_files(spec, expected_sha256)
    module = formats.load(spec.manifest, spec.folder, spec.allowed_factories)
    seed = spec._version.perturb_seed
    if seed is not None:
        perturb(module, seed)
    return module


def perturb(module: nn.Module, seed: int, scale: float = PERTURB_SCALE) -> None:
    """Adds seeded noise of `scale` x each parameter's std (deterministic across processes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            std = float(param.float().std()) if param.numel() > 1 else 1.0
            noise = torch.randn(param.shape, generator=generator) * (scale * (std or 1.0))
            param.add_(noise.to(param.dtype))


@dataclass
class Repository:
    """Models by (name, version) under `root`; model.toml is read at every lookup."""

    root: Path
    allowed_factories: tuple[str, ...] = ()
    _cache: dict[str, tuple[tuple[int, ...], ModelToml]] = field(default_factory=dict, repr=False)

    @classmethod
    def with_builtins(cls) -> Repository:
        return cls(default_repository())

    def manifest(self, name: str) -> ModelToml:
        if not NAME.match(name):
            raise ModelNotFound(f"{name!r} is not a repository model name; known models: {self._known()}")
        folder = self.root / name
        if not folder.is_dir():
            raise ModelNotFound(f"unknown model {name!r}; known models: {self._known()}")
        try:
            st = (folder / "model.toml").stat()
            # model.toml is only ever replaced by rename, so a new file has a new inode
            # (timestamps alone are too coarse: two writes within a tick share one)
            key: tuple[int, ...] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = ()
        cached = self._cache.get(name)
        if cached is not None and cached[0] == key and key:
            return cached[1]
        manifest = read_model_toml(folder)
        self._cache[name] = (key, manifest)
        return manifest

    def _known(self) -> str:
        return ", ".join(self.names()) or f"none (the repository {self.root} is empty)"

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and NAME.match(p.name))

    def versions(self, name: str) -> list[str]:
        return sorted(v.name for v in self.manifest(name).versions)

    def default_version(self, name: str) -> str:
        manifest = self.manifest(name)
        versions = sorted(v.name for v in manifest.versions)
        if manifest.default_version:
            return manifest.default_version
        return DEFAULT_VERSION if DEFAULT_VERSION in versions else versions[0]

    def get(self, name: str, version: str = "") -> ModelSpec:
        manifest = self.manifest(name)
        version = version or self.default_version(name)
        if manifest.version(version) is None:
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; versions: {', '.join(self.versions(name))}"
            )
        return ModelSpec(name, version, manifest, self.root / name / version, self.allowed_factories)

    def entries(self) -> list[tuple[str, str]]:
        """(name, version) of every model whose model.toml parses (others are skipped)."""
        out = []
        for name in self.names():
            try:
                out += [(name, v) for v in self.versions(name)]
            except ManifestError:
                continue
        return out


def default_repository() -> Path:
    """$SWITCHYARD_MODELS_REPOSITORY, else a cache folder seeded with the built-ins (once)."""
    configured = os.environ.get("SWITCHYARD_MODELS_REPOSITORY", "")
    if configured:
        return Path(configured)
    digest = hashlib.sha256()
    for toml in sorted(BUILTIN.glob("*/model.toml")):
        digest.update(toml.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "switchyard" / f"models-{digest.hexdigest()[:12]}"
    seed_builtins(root)
    return root
