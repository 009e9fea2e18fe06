"""Planted models whose defects show only under load: the same small MLP as
tests/trial/planted.py, wrong on a small share of calls or only at batch sizes above 1, on any
device (the reference runs the `honest` version, so only the candidate's version misbehaves):

- `honest`: no defect, the control;
- `flaky`: BIAS added to every EVERY-th call's output (counted per loaded model), so the fixed
  inputs of the correctness phase, a handful of calls, meet the reference;
- `rows`: BIAS added when the batch holds more than one row, so batch 1 is always right;
- `leaky`: right on every call, but each call keeps a LEAK_BYTES tensor alive in a module-level
  list (a cache that is never emptied), so the executor process grows by 16 KiB per request;
- `cold`: right on every call, but its first COLD_CALLS calls after loading take COLD_S more
  (a cache filled lazily, a JIT that settles late), past a warm-up of 48 and into the first
  third of the measurement, so its latency drifts down while it is measured.

One factory-format repository entry, `planted-load`, with a version per defect.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from switchyard.models.registry import UserModel
from tests.trial.planted import FEATURES, HIDDEN, OUTPUTS, factory_toml, planted_user_model, save_version

BIAS = 1e-3
EVERY = 37
LEAK_BYTES = 16 << 10
COLD_CALLS = 100  # warm-up 48, the correctness inputs, then about the first half of those measured
COLD_S = 0.02  # 10 to 100 times this MLP's own time per call, however loaded the host
DEFECTS = ("honest", "flaky", "rows", "leaky", "cold")
KEPT: list[torch.Tensor] = []  # what `leaky` keeps alive, for the life of the executor process


class PlantedLoad(nn.Module):
    """The network; its defect is read from the weights file (`defect_code`) when they load."""

    def __init__(self, defect: str = "honest") -> None:
        super().__init__()
        self.defect = defect
        self.calls = 0
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUTPUTS)
        self.register_buffer("defect_code", torch.tensor(DEFECTS.index(defect), dtype=torch.int64))
        self.register_load_state_dict_post_hook(_read_defect)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        if self.defect == "flaky" and self.calls % EVERY == 0:
            y = y + BIAS
        if self.defect == "rows" and x.shape[0] > 1:
            y = y + BIAS
        if self.defect == "leaky":  # filled, so its pages are resident
            KEPT.append(torch.full((LEAK_BYTES // 4,), float(self.calls), dtype=torch.float32))
        if self.defect == "cold" and self.calls <= COLD_CALLS:
            time.sleep(COLD_S)
        return y


def _read_defect(module: nn.Module, _incompatible: Any) -> None:
    assert isinstance(module, PlantedLoad)
    module.defect = DEFECTS[int(module.get_buffer("defect_code"))]


def build() -> UserModel:
    """The factory of the repository entry (every version; the weights pick the defect)."""
    return planted_user_model(PlantedLoad())


MODEL_TOML = factory_toml(
    __name__, f"planted MLP wrong only under load: on every {EVERY}th call, or at batch > 1"
)


def write_version(folder: Path, defect: str) -> Path:
    """A folder to add as one version: model.toml and the seeded weights with the defect's code."""
    return save_version(folder, lambda: PlantedLoad(defect), MODEL_TOML)
