"""The optimizer every training run on an executor uses (single-process Train and each rank).

SGD with momentum 0.9, its momentum buffers made as zeros before the first step. With dampening
0 a zero buffer gives exactly what torch's lazy first step does (buf = 0 * 0.9 + grad = grad),
so the losses are bit-identical; but on a lazy-tensor path the first step then has the same
graph as every later one. Left to torch, step 1 clones the gradients into new buffers and step 2
updates them: two different XLA graphs, each compiled (the mlp's training step took ~20 s to
compile on PJRT CPU, so Train paid ~40 s before its first fast step; now ~20 s).
"""

from __future__ import annotations

import torch
from torch import nn

MOMENTUM = 0.9


def momentum_sgd(module: nn.Module, lr: float) -> torch.optim.SGD:
    """SGD over `module`'s parameters with zero momentum buffers on their devices.

    The caller synchronises the device afterwards, so on XLA the buffers are device data (inputs
    of the step's graph) rather than constants folded into the first step's graph.
    """
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=MOMENTUM)
    for param in module.parameters():
        if param.requires_grad:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param).detach()
    return optimizer
