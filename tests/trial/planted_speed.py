"""Planted models slower by a known factor: the same small MLP as tests/trial/planted.py,
whose every call also waits BASE_S times its version's factor, on any device. The wait
dominates a call's latency, so `slow2` is about 2x the `honest` reference end to end, and
`slow105` about 1.05x (a little under: the call's own overhead is not multiplied). BASE_S is
long enough to dominate even on a host so busy that a call waits tens of ms to be scheduled
(a 10 ms wait gave slow2 1.076 [0.615, 1.541] at a reference p95 of 114 ms there).

One factory-format repository entry, `planted-speed`, with a version per factor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from switchyard.models.registry import UserModel
from tests.trial.planted import FEATURES, HIDDEN, OUTPUTS, factory_toml, planted_user_model, save_version

BASE_S = 0.1
FACTORS = {"honest": 1.0, "slow2": 2.0, "slow105": 1.05}


class PlantedSpeed(nn.Module):
    """The network; its factor is read from the weights file (`factor`) when they load."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.wait_s = BASE_S * factor
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUTPUTS)
        self.register_buffer("factor", torch.tensor(factor, dtype=torch.float64))
        self.register_load_state_dict_post_hook(_read_factor)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.wait_s)
        y: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return y


def _read_factor(module: nn.Module, _incompatible: Any) -> None:
    assert isinstance(module, PlantedSpeed)
    module.wait_s = BASE_S * float(module.get_buffer("factor"))


def build() -> UserModel:
    """The factory of the repository entry (every version; the weights pick the factor)."""
    return planted_user_model(PlantedSpeed())


MODEL_TOML = factory_toml(
    __name__, f"planted MLP slower by its version's factor: each call waits {BASE_S} s times it"
)


def write_version(folder: Path, version: str) -> Path:
    """A folder to add as one version: model.toml and the seeded weights with the factor."""
    return save_version(folder, lambda: PlantedSpeed(FACTORS[version]), MODEL_TOML)
