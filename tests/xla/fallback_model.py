"""A user model with an op torch_xla 2.9 cannot lower: `torch.median(dim)` runs on the host.

Added to the XLA executor's model repository (factory format: this module's `build` and a
safetensors file; the executor allows factories of the `tests` package), it shows
the fallback captured as a compatibility finding (`aten::median.dim_values`) while the output
still matches the CPU path. The factory runs inside the executor's process, so this module
imports only what the XLA environment has.
"""

from __future__ import annotations

import torch
from torch import nn

from switchyard.models.registry import TensorSpec, UserModel

FEATURES = 16
FACTORY = "tests.xla.fallback_model:build"


class MedianHead(nn.Module):
    """A linear layer, then the per-row median of its features: robust pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.median(self.fc(x), dim=-1, keepdim=True).values


def build() -> UserModel:
    return UserModel(
        module=MedianHead(),
        inputs=(TensorSpec("x", "FP32", (FEATURES,)),),
        outputs=(TensorSpec("y", "FP32", (1,)),),
    )


def seeded_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return {k: v.detach().clone() for k, v in MedianHead().state_dict().items()}
