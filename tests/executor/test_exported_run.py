"""An exported program runs its graph's forward after one checked call (backends.torch_native)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from services.executor.backends.torch_native import CpuBackend
from tests.executor.user_model import Scaler


def _exported(tmp_path: Path) -> nn.Module:
    """Scaler as a repository's torch_export model is loaded: saved, loaded, `.module()`."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Scaler().eval(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    return torch.export.load(str(tmp_path / "model.pt2")).module()


def _count_input_matches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts torch.export's per-call input match (its pre-hook's work), calling through."""
    import torch.export._unlift as unlift

    calls = [0]
    real = unlift._check_inputs_match

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(unlift, "_check_inputs_match", counting)
    return calls


def test_an_exported_program_is_checked_once_and_answers_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _exported(tmp_path)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        expected = module(x)
        calls = _count_input_matches(monkeypatch)
        prepared = CpuBackend().prepare(module, "eager")
        outs = [prepared.run([x]) for _ in range(3)]
    assert calls[0] == 1  # the first call went through the hooks, the others did not
    for out in outs:
        assert torch.equal(out, expected)


def test_the_graph_still_guards_shapes_without_the_hooks(tmp_path: Path) -> None:
    prepared = CpuBackend().prepare(_exported(tmp_path), "eager")
    with torch.inference_mode():
        prepared.run([torch.randn(1, 4)])  # the checked call
        with pytest.raises(Exception, match=r"(?i)shape|size|expected|guard"):
            prepared.run([torch.randn(1, 5)])  # wrong feature size: refused in the graph


def test_a_module_with_another_hook_keeps_calling_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    exported = _exported(tmp_path)
    exported.register_forward_pre_hook(lambda module, args: seen.append(1))
    plain = Scaler().eval()
    plain.register_forward_pre_hook(lambda module, args: seen.append(2))
    calls = _count_input_matches(monkeypatch)
    with torch.inference_mode():
        for module in (exported, plain):
            prepared = CpuBackend().prepare(module, "eager")
            for _ in range(3):
                prepared.run([torch.randn(2, 4)])
    assert seen == [1, 1, 1, 2, 2, 2]
    assert calls[0] == 3  # the exported one's own checks ran on every call too
