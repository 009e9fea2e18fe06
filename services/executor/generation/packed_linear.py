"""The eager cpu engine's linear layers on oneDNN, their weights packed once at load.

`nn.Linear` on the host CPU runs torch's default fp32 GEMM. On this project's hosts (AMD
EPYC with AVX-512) that path reached 44-88 GFLOP/s on one thread for a 32-row decode step's
shapes, while oneDNN's matmul over a weight reordered into its own blocked layout, as vLLM's
CPU build runs its linear layers (`onednn_mm`) and inductor's freezing pass does, took
2-3x less time for the same shapes (32 rows: q/k/v 0.82 -> 0.16 ms, gate/up 2.58 -> 0.45 ms,
the LM head over 8192 tokens 3.74 -> 1.27 ms). Its sums are still fp32 (oneDNN's strict
fp32 math unless asked otherwise): within 4e-6 of a float64 product where torch's own GEMM
is within 2e-6, a different order of the same additions.

`pack_linears` swaps every fp32 `nn.Linear` of a module for a `PackedLinear` holding the
packed weight (a copy: a weight shared with another module, such as a tied embedding, stays
where it was). Only where oneDNN is built in and only for eager mode on the host CPU:
inductor (`mode = "compile"`) traces its own GEMMs, and other dtypes keep torch's path.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear ops (the x86 and arm64 CPU builds do)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight in oneDNN's layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def _host_fp32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def pack_linears(module: nn.Module) -> int:
    """Swaps `module`'s fp32 cpu `nn.Linear` layers for `PackedLinear`s; how many it swapped."""
    if not packing_available():
        return 0
    swaps = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and _host_fp32(child.weight)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
