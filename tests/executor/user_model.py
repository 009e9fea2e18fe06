"""A user model factory for tests (imported by path, as a user's would be)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from switchyard.models.registry import TensorSpec, UserModel


class Scaler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(features))


class Breaking(Scaler):
    """Forces a dynamo graph break, so compile mode has a finding to report."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(features)
        torch._dynamo.graph_break()
        return torch.tanh(hidden)


def build() -> UserModel:
    return UserModel(Scaler(), (TensorSpec("features", "FP32", (4,)),), (TensorSpec("score", "FP32", (2,)),))


def build_breaking() -> UserModel:
    return UserModel(
        Breaking(), (TensorSpec("features", "FP32", (4,)),), (TensorSpec("score", "FP32", (2,)),)
    )


def not_a_user_model() -> nn.Module:
    return Scaler()


class Failing(Scaler):
    """Fails on huge inputs (after a clean warm-up), as a model bug would."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if float(features.abs().max()) > 1e6:
            raise ValueError("secret internal detail")
        return super().forward(features)


def build_failing() -> UserModel:
    return UserModel(Failing(), (TensorSpec("features", "FP32", (4,)),), (TensorSpec("score", "FP32", (2,)),))


def add_user_model(
    root: Path, name: str, function: str, module: nn.Module, allowed: tuple[str, ...] = ("tests",)
) -> str:
    """A factory-format model added to the repository at `root` as a user would add it: a
    folder with model.toml (the factory; inputs/outputs come from its UserModel) and the
    weights; returns the artifact sha256."""
    from safetensors.torch import save_file

    from clients.model_admin import add_model

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp)
        (source / "model.toml").write_text(f'format = "factory"\n[factory]\nfunction = "{function}"\n')
        save_file(
            {k: v.contiguous() for k, v in module.state_dict().items()}, str(source / "model.safetensors")
        )
        spec, _ = add_model(root, name, source, version="1", replace=True, allowed_factories=allowed)
    return spec.sha256
