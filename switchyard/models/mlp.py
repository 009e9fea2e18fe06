"""The `mlp` reference model: the "simple load" (three linear layers with GELU).

Input `x` FP32 [batch, 64]; output `y` FP32 [batch, 16]. Weights are seeded and committed as
safetensors under `checkpoints/` (see `make_checkpoints.py`).
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 64
HIDDEN = 1024
OUT_FEATURES = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.fc1(x))
        h = nn.functional.gelu(self.fc2(h))
        return self.fc3(h)  # type: ignore[no-any-return]


def build() -> MLP:
    return MLP()


def example_inputs(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(batch, IN_FEATURES, generator=generator)]


def train_loss(
    module: nn.Module, batch: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Regression onto a fixed random linear map of the input: a loss that really decreases."""
    x = torch.randn(batch, IN_FEATURES, generator=generator)
    target_map = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(7))
    y = (x @ target_map) / IN_FEATURES**0.5
    out = module(x.to(device=device, dtype=dtype))
    return nn.functional.mse_loss(out, y.to(device=device, dtype=dtype))
