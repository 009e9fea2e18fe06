"""The eager cpu engine's oneDNN-packed linear layers (generation/packed_linear.py): what is
swapped and what is left, that each computes what `nn.Linear` does (fp32, within rounding),
and that a cpu eager load packs the model's layers and says so. That greedy tokens still equal
`generate()` through them is tested in test_generation.py (the cpu eager executors)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.executor.generation.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 16, bias=False))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LMs' heads are
        self.wide = nn.Linear(16, 16).double()  # not fp32: left to torch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.embed(ids)))
        return out


def test_fp32_linears_are_packed_and_compute_what_nn_linear_does() -> None:
    torch.manual_seed(0)
    model = _Model().eval()
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        before = model(ids)
        assert pack_linears(model) == 3
        after = model(ids)
        assert pack_linears(model) == 0  # nothing left to pack
    assert isinstance(model.block[0], PackedLinear) and isinstance(model.head, PackedLinear)
    assert type(model.wide) is nn.Linear  # float64 keeps torch's GEMM
    assert model.embed.weight.shape == (50, 16)  # the tied weight stays the embedding's
    assert after.shape == before.shape == (3, 7, 50) and after.dtype == torch.float32
    assert (after - before).abs().max().item() < 1e-5


@pytest.mark.parametrize("rows", [0, 1, 32, 257])
def test_a_packed_layer_takes_any_number_of_rows(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        got = PackedLinear(linear)(x)
    assert got.shape == (rows, 96)
    assert rows == 0 or (got.double() - expected).abs().max().item() < 1e-5
