"""The XLA counter arithmetic, against a fake metrics source (the main env has no torch_xla).

The same code reads the real `torch_xla.debug.metrics` in tests/xla/test_xla_executor.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.executor.backends.xla import to_compile_counters
from services.executor.backends.xla_compat import XlaCounters, fallback_notes, snapshot


class FakeMetrics:
    """Monotonic counters as torch_xla keeps them."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {"RegisterXLAFunctions": 1}
        self.compile_ns = 0.0

    def counters(self) -> Mapping[str, int]:
        return dict(self.values)

    def metric_total(self, name: str) -> float:
        return self.compile_ns if name == "CompileTime" else 0.0

    def bump(self, name: str, by: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + by


def test_snapshot_before_any_compile_is_zero() -> None:
    assert snapshot(FakeMetrics()) == XlaCounters()


def test_difference_keeps_only_what_happened_in_between() -> None:
    met = FakeMetrics()
    met.bump("UncachedCompile", 3)
    met.bump("aten::nonzero", 2)
    met.compile_ns = 5e8
    before = snapshot(met)
    met.bump("UncachedCompile")
    met.bump("CachedCompile", 4)
    met.bump("ExecuteComputation", 5)
    met.bump("aten::median.dim_values")
    met.bump("xla::addmm", 9)  # lowered ops are not fallbacks
    met.compile_ns = 7.5e8
    delta = snapshot(met).since(before)
    assert delta.uncached_compiles == 1
    assert delta.cached_compiles == 4
    assert delta.executions == 5
    assert delta.compile_time_s == 0.25
    assert dict(delta.fallback_ops) == {"aten::median.dim_values": 1}
    reported = to_compile_counters(delta)  # what LoadModel's compatibility report carries
    assert (reported.compilations, reported.cached_compilations) == (1, 4)


def test_plus_adds_phases_and_notes_name_each_fallback() -> None:
    a = XlaCounters(uncached_compiles=2, compile_time_ns=1e9, fallback_ops={"aten::nonzero": 1})
    b = XlaCounters(
        uncached_compiles=1, compile_time_ns=5e8, fallback_ops={"aten::nonzero": 2, "aten::sort": 1}
    )
    total = a.plus(b)
    assert total.uncached_compiles == 3 and total.compile_time_s == 1.5
    assert dict(total.fallback_ops) == {"aten::nonzero": 3, "aten::sort": 1}
    notes = fallback_notes(total.fallback_ops)
    assert notes[0].startswith("aten::nonzero ran on the host CPU 3x")
