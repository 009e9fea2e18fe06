"""The shadow's local rule on decoded outputs (switchyard/judge/output_divergence.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from switchyard.judge.output_divergence import outputs_divergence


def test_the_worst_output_decides() -> None:
    ref = {"a": np.array([1.0, 2.0]), "b": np.array([[0.0, 1.0]])}
    same = outputs_divergence(ref, {k: v.copy() for k, v in ref.items()}, atol=1e-5, rtol=1e-4)
    assert not same.diverged and same.max_abs_error == 0.0 and same.cosine == pytest.approx(1.0)
    off = outputs_divergence(ref, {"a": np.array([1.0, 2.5]), "b": ref["b"]}, atol=1e-5, rtol=1e-4)
    assert off.diverged and off.max_abs_error == pytest.approx(0.5) and off.mismatch_share == 0.5
    assert off.reason.startswith("a:")


def test_names_shapes_and_bytes_must_agree() -> None:
    one = {"a": np.array([1.0])}
    names = outputs_divergence(one, {"z": np.array([1.0])}, atol=0.0, rtol=0.0)
    assert names.diverged and math.isinf(names.max_abs_error) and "outputs differ" in names.reason
    shape = outputs_divergence(one, {"a": np.array([1.0, 2.0])}, atol=0.0, rtol=0.0)
    assert shape.diverged and "shape" in shape.reason
    text = {"t": np.array([b"yes"], dtype=object)}
    assert not outputs_divergence(text, text, atol=0.0, rtol=0.0).diverged
    other = outputs_divergence(text, {"t": np.array([b"no"], dtype=object)}, atol=0.0, rtol=0.0)
    assert other.diverged and other.cosine == 0.0
