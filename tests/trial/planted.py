"""Planted-defect models: one small MLP whose candidate path alone misbehaves, one defect each.

Every version is the same network and weights; the defect applies only where the tensors
live on an XLA device (`x.device.type == "xla"`), so the cpu-eager reference, and its float64
golden run, see the honest model. A trial that compares cpu-eager with xla must name each
defect:

- `honest`: no defect, the control;
- `bias`: a constant 1e-3 added to every output (wrong but stable);
- `noise`: fresh Gaussian noise (std 1e-2) on every call (non-deterministic);
- `median`: an exact no-op built from `torch.median(dim)`, which torch_xla 2.9 cannot lower
  and runs on the host CPU (`aten::median.dim_values`, once per request);
- `shapes`: the hidden layer rebuilt through `torch.nonzero`, whose output shape depends on
  the data, so XLA compiles a new graph for each new count (and runs nonzero on the host);
  the values stay exact;
- `sleep`: `SLEEP_S` of sleep per call.

It is one factory-format repository entry, `planted`, with a version per defect: the same
weights plus a `defect_code` that says which. The factory runs inside the executors'
processes (the XLA one too), so this module imports only torch and the registry; the trial
stack allow-lists the `tests` package for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from switchyard.models.registry import TensorSpec, UserModel

FEATURES, HIDDEN, OUTPUTS = 16, 64, 8
BIAS = 1e-3
NOISE_STD = 1e-2
SLEEP_S = 0.3
DEFECTS = ("honest", "bias", "noise", "median", "shapes", "sleep")


def _bias(y: torch.Tensor) -> torch.Tensor:
    return y + BIAS


def _noise(y: torch.Tensor) -> torch.Tensor:
    return y + NOISE_STD * torch.randn_like(y)


def _median(y: torch.Tensor) -> torch.Tensor:
    m = torch.median(y, dim=-1, keepdim=True).values
    return y + (m - m)  # exactly y: only the host fallback is left of it


def _sleep(y: torch.Tensor) -> torch.Tensor:
    time.sleep(SLEEP_S)
    return y


def _data_dependent(h: torch.Tensor) -> torch.Tensor:
    """h again, exactly, through a tensor whose shape is the number of positive entries."""
    flat = h.flatten()
    idx = torch.nonzero(flat > 0).squeeze(1)
    kept = torch.zeros_like(flat).index_put((idx,), flat[idx])
    return (kept + flat.clamp(max=0)).view_as(h)


_ON_OUTPUT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bias": _bias,
    "noise": _noise,
    "median": _median,
    "sleep": _sleep,
}


class Planted(nn.Module):
    """The network; which defect it plants is in its weights file (`defect_code`), read once
    when the weights load (on the CPU), so forward never asks the device for it."""

    def __init__(self, defect: str = "honest") -> None:
        super().__init__()
        self.defect = defect
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUTPUTS)
        self.register_buffer("defect_code", torch.tensor(DEFECTS.index(defect), dtype=torch.int64))
        self.register_load_state_dict_post_hook(_read_defect)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        candidate = x.device.type == "xla"
        h = torch.tanh(self.fc1(x))
        if candidate and self.defect == "shapes":
            h = _data_dependent(h)
        y: torch.Tensor = self.fc2(h)
        if candidate and self.defect in _ON_OUTPUT:
            y = _ON_OUTPUT[self.defect](y)
        return y


def _read_defect(module: nn.Module, _incompatible: Any) -> None:
    assert isinstance(module, Planted)
    module.defect = DEFECTS[int(module.get_buffer("defect_code"))]


def build() -> UserModel:
    """The factory of the repository entry (every version; the weights pick the defect)."""
    return planted_user_model(Planted())


def planted_user_model(module: nn.Module) -> UserModel:
    """A planted MLP as a user model: FEATURES in, OUTPUTS out (every planted file's shape)."""
    inputs, outputs = (TensorSpec("x", "FP32", (FEATURES,)),), (TensorSpec("y", "FP32", (OUTPUTS,)),)
    return UserModel(module, inputs, outputs)


def factory_toml(factory: str, description: str) -> str:
    """model.toml of a planted factory entry (`factory` is its module's `build`)."""
    return f"""format = "factory"
description = "{description}"

[[inputs]]
name = "x"
datatype = "FP32"
dims = [{FEATURES}]

[[outputs]]
name = "y"
datatype = "FP32"
dims = [{OUTPUTS}]

[factory]
function = "{factory}:build"
"""


def save_version(folder: Path, module: Callable[[], nn.Module], model_toml: str) -> Path:
    """A folder to add as one version: model.toml and the weights of `module()` built under one
    seed (so every version has the same weights, and its buffers say what it plants)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(20)
        state = {k: v.detach().clone() for k, v in module().state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "model.toml").write_text(model_toml)
    return folder


MODEL_TOML = factory_toml(__name__, "planted-defect MLP: each version misbehaves on XLA devices only")


def write_version(folder: Path, defect: str) -> Path:
    """A folder to add as one version: model.toml and the seeded weights (the same for every
    defect) with the defect's code."""
    return save_version(folder, lambda: Planted(defect), MODEL_TOML)
