"""The `mlp` reference model: the "simple load", a deep narrow residual MLP.

Input `x` FP32 [batch, 64]; output `y` FP32 [batch, 16]. An input projection to width 128,
`DEPTH` pre-norm residual blocks (LayerNorm, Linear, GELU, add), a final norm and a
projection to 16. Its cost at small batch is per operator call, not per row (in eager
PyTorch on this CPU: batch 1 about 5.5 ms, batch 16 about 7 ms), which is the
regime dynamic batching exists for: one call serves a batch for the price of a request.
Weights are seeded and committed as safetensors under `checkpoints/` (see
`tools/make_checkpoints.py`).
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 64
WIDTH = 128
DEPTH = 96
OUT_FEATURES = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.gelu(self.fc(self.norm(h)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.fc_out = nn.Linear(WIDTH, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        for block in self.blocks:
            h = block(h)
        return self.fc_out(self.norm(h))  # type: ignore[no-any-return]


def build() -> MLP:
    return MLP()


def example_inputs(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(batch, IN_FEATURES, generator=generator)]


def train_batch(batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Inputs and targets of a fixed random linear map (rows drawn in order)."""
    x = torch.randn(batch, IN_FEATURES, generator=generator)
    target_map = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(7))
    return [x, (x @ target_map) / IN_FEATURES**0.5]


def batch_loss(
    module: nn.Module, data: list[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Regression onto the map: a loss that really decreases."""
    x, y = data
    out = module(x.to(device=device, dtype=dtype))
    return nn.functional.mse_loss(out, y.to(device=device, dtype=dtype))


def train_loss(
    module: nn.Module, batch: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return batch_loss(module, train_batch(batch, generator), dtype, device)
