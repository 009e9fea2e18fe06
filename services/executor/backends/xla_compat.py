"""Compatibility capture for torch_xla: what XLA compiled, how long it took, what fell back.

torch_xla keeps process-wide counters in `torch_xla.debug.metrics`:
- `UncachedCompile` counts XLA compilations (a graph not in the compilation cache);
- the `CompileTime` metric accumulates compile time in nanoseconds;
- every `aten::<op>` counter is an op that XLA could not lower and ran on the host CPU
  (a fallback: correct, but it splits the graph and copies tensors device->host->device).

The counters are global and monotonic, so each phase takes a `snapshot()` before and after
and keeps the difference (`XlaCounters.since`). Everything here reads a `MetricsSource`, so
the arithmetic is testable with a fake in the main environment (which has no torch_xla);
`TorchXlaMetrics` is the real source and imports torch_xla only when constructed.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, Protocol

UNCACHED_COMPILE = "UncachedCompile"
CACHED_COMPILE = "CachedCompile"
COMPILE_TIME = "CompileTime"
EXECUTE = "ExecuteComputation"
FALLBACK_PREFIX = "aten::"
_READ = frozenset({UNCACHED_COMPILE, CACHED_COMPILE, EXECUTE})


class MetricsSource(Protocol):
    """The two calls of `torch_xla.debug.metrics` this module needs."""

    def counters(self) -> Mapping[str, int]:
        """Every counter by name (absent counters are simply missing)."""
        ...

    def metric_total(self, name: str) -> float:
        """The accumulated value of a metric (0 when it has no samples yet)."""
        ...


class TorchXlaMetrics:
    """The real source: `torch_xla.debug.metrics` of this process."""

    def __init__(self) -> None:
        self._met: Any = importlib.import_module("torch_xla.debug.metrics")

    def counters(self) -> Mapping[str, int]:
        # Only the counters this module reads: each is a C call, and this runs twice per batch.
        names = [n for n in self._met.counter_names() if n in _READ or n.startswith(FALLBACK_PREFIX)]
        return {str(name): int(self._met.counter_value(name) or 0) for name in names}

    def metric_total(self, name: str) -> float:
        # metric_data returns (total_samples, accumulator, samples) or None before the first sample.
        data = self._met.metric_data(name)
        return float(data[1]) if data else 0.0


@dataclasses.dataclass(frozen=True)
class XlaCounters:
    """A reading of (or a difference between two readings of) the XLA counters."""

    uncached_compiles: int = 0
    cached_compiles: int = 0
    executions: int = 0
    compile_time_ns: float = 0.0
    fallback_ops: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def compile_time_s(self) -> float:
        return self.compile_time_ns / 1e9

    def since(self, before: XlaCounters) -> XlaCounters:
        """What happened between `before` and this reading."""
        ops = {
            op: count - before.fallback_ops.get(op, 0)
            for op, count in self.fallback_ops.items()
            if count - before.fallback_ops.get(op, 0) > 0
        }
        return XlaCounters(
            uncached_compiles=self.uncached_compiles - before.uncached_compiles,
            cached_compiles=self.cached_compiles - before.cached_compiles,
            executions=self.executions - before.executions,
            compile_time_ns=self.compile_time_ns - before.compile_time_ns,
            fallback_ops=dict(sorted(ops.items())),
        )

    def plus(self, other: XlaCounters) -> XlaCounters:
        """Two differences added (e.g. load plus warm-up)."""
        ops = dict(self.fallback_ops)
        for op, count in other.fallback_ops.items():
            ops[op] = ops.get(op, 0) + count
        return XlaCounters(
            uncached_compiles=self.uncached_compiles + other.uncached_compiles,
            cached_compiles=self.cached_compiles + other.cached_compiles,
            executions=self.executions + other.executions,
            compile_time_ns=self.compile_time_ns + other.compile_time_ns,
            fallback_ops=dict(sorted(ops.items())),
        )


def snapshot(source: MetricsSource) -> XlaCounters:
    """The current process-wide XLA counters."""
    counters = source.counters()
    return XlaCounters(
        uncached_compiles=int(counters.get(UNCACHED_COMPILE, 0)),
        cached_compiles=int(counters.get(CACHED_COMPILE, 0)),
        executions=int(counters.get(EXECUTE, 0)),
        compile_time_ns=source.metric_total(COMPILE_TIME),
        fallback_ops={
            name: int(count)
            for name, count in sorted(counters.items())
            if name.startswith(FALLBACK_PREFIX) and count > 0
        },
    )


def fallback_notes(fallbacks: Mapping[str, int]) -> list[str]:
    """One line per fallback op saying why it matters for a migration."""
    return [
        f"{op} ran on the host CPU {count}x (no XLA lowering): graph split and device<->host copies"
        for op, count in fallbacks.items()
    ]
