"""Which paths of a trial are measured together in alternating blocks, and the order their
other phases keep meanwhile. Runs in the workflow sandbox.

Paths on different hosts are measured at the same time. Paths that share a host must not
measure at once (they would slow each other), and measured one after the other, a change of
the host's load between the two measurements lands on one path only, which no interval over
one path's blocks can see. So the reference and the candidates on its host that can be loaded
beside it form an `Interleaved` group: each member prepares and runs its correctness in turn
(the reference first: its float64 golden run loads the model its own way), then the group is
measured by one activity in alternating blocks (workflows/tensor/performance.py), then each trains
in turn, and they clean up in reverse order, the reference last.

An executor holds one load per model name and version (services/executor/executor_runtime.py
keys its models so). Two paths can be loaded at once when they are on different executors,
when they load different versions, or when their loads are the same (an A/A trial: the very
same loaded instance, measured in alternation with itself). Two paths of one version with
different modes or precisions on one executor cannot: each load would replace the other. Such
a candidate is measured after the group, alone (`Alone`), and its report says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from temporalio import workflow

from workflows.pipeline.context import TrialContext
from workflows.pipeline.types import (
    ExtensionRule,
    InterleavedRequest,
    PathInfo,
    PerformanceRequest,
    PerformanceResult,
    Target,
)
from workflows.tensor.performance import PerformanceActivities


def same_load(a: Target, b: Target, a_info: PathInfo, b_info: PathInfo) -> bool:
    """The two paths load the same thing on the same executor: one loaded instance."""
    mine = (a_info.address, a.model, a.version, a.mode, a.precision, tuple(a.batch_buckets))
    return mine == (b_info.address, b.model, b.version, b.mode, b.precision, tuple(b.batch_buckets))


def load_conflict(a: Target, b: Target, a_info: PathInfo, b_info: PathInfo) -> str:
    """Why two paths cannot be loaded at the same time ("" when they can)."""
    if a_info.address != b_info.address or a.model != b.model or same_load(a, b, a_info, b_info):
        return ""
    if a.version and b.version and a.version != b.version:
        return ""  # two keys on the executor
    version = a.version or b.version or "default"
    return (
        f"{a.path} and {b.path} need different loads of {a.model}:{version} on one executor "
        f"({a_info.address}), which holds one load per model version"
    )


@dataclass
class Plan:
    members: list[str]  # the reference first, then the candidates measured with it
    apart: dict[str, str] = field(default_factory=dict)  # a candidate on the host, and why not
    shared: set[str] = field(default_factory=set)  # members that use another member's load


def plan(reference: tuple[Target, PathInfo], candidates: list[tuple[Target, PathInfo]]) -> Plan:
    """The group of the reference's host: each candidate there that can be loaded beside
    every member so far joins it, in the spec's order."""
    ref_target, ref_info = reference
    chosen = [reference]
    result = Plan([ref_target.path])
    for target, info in candidates:
        if info.host != ref_info.host:
            continue
        conflict = next((c for c in (load_conflict(t, target, i, info) for t, i in chosen) if c), "")
        if conflict:
            result.apart[target.path] = conflict
            continue
        if any(same_load(t, target, i, info) for t, i in chosen):
            result.shared.add(target.path)
        chosen.append((target, info))
        result.members.append(target.path)
    return result


class Alone:
    """A path measured by itself: no turns to wait for."""

    def __init__(self, ctx: TrialContext, why_apart: str = "") -> None:
        self.ctx = ctx
        self.why_apart = why_apart

    @asynccontextmanager
    async def turn(self, name: str, step: str) -> AsyncIterator[None]:
        yield

    async def measure(self, name: str, request: PerformanceRequest) -> PerformanceResult:
        measured = await self.ctx.call(PerformanceActivities.measure_performance, request)
        return replace(measured, not_interleaved=self.why_apart)

    def withdraw(self, name: str) -> None:
        pass

    def leave(self, name: str) -> None:
        pass

    def finished(self, name: str) -> None:
        pass

    async def last_out(self, name: str) -> None:
        pass


class Interleaved:
    """The members' turns: setup (prepare, correctness) and training one member at a time in
    order, the measurement of all at once, the first member's cleanup after every other's."""

    def __init__(self, ctx: TrialContext, members: list[str]) -> None:
        self.ctx = ctx
        self.members = members
        self.done: dict[tuple[str, str], asyncio.Event] = {
            (m, step): asyncio.Event() for m in members for step in ("setup", "training", "finished")
        }
        self.requests: dict[str, PerformanceRequest] = {}
        self.withdrawn: set[str] = set()
        self.results: asyncio.Task[dict[str, PerformanceResult]] | None = None

    @asynccontextmanager
    async def turn(self, name: str, step: str) -> AsyncIterator[None]:
        """Run a member's step after the member before it has done that step (or left)."""
        index = self.members.index(name)
        if index:
            await self.done[(self.members[index - 1], step)].wait()
        try:
            yield
        finally:
            self.done[(name, step)].set()

    async def measure(self, name: str, request: PerformanceRequest) -> PerformanceResult:
        """Wait for every member's request (or its withdrawal), then measure them together."""
        self.requests[name] = request
        await workflow.wait_condition(
            lambda: all(m in self.requests or m in self.withdrawn for m in self.members)
        )
        if self.results is None:
            self.results = asyncio.ensure_future(self._together())
        return (await self.results)[name]

    async def _together(self) -> dict[str, PerformanceResult]:
        names = [m for m in self.members if m in self.requests]
        if len(names) == 1:
            alone = await self.ctx.call(PerformanceActivities.measure_performance, self.requests[names[0]])
            return {names[0]: alone}
        together = InterleavedRequest([self.requests[n] for n in names], self._extension())
        measured = await self.ctx.call(PerformanceActivities.measure_interleaved, together)
        return {
            n: replace(r, interleaved_with=[o for o in names if o != n])
            for n, r in zip(names, measured.results, strict=True)
        }

    def _extension(self) -> ExtensionRule | None:
        """How far the measurement may extend itself (workflows/tensor/extension.py): from the
        spec alone, so a replayed workflow schedules the same activity."""
        spec = self.ctx.spec
        if not spec.performance.max_extra_requests:
            return None
        policy = spec.policy
        return ExtensionRule(
            spec.reference, spec.performance.max_extra_requests, policy.max_p95_regression, policy.confidence
        )

    def withdraw(self, name: str) -> None:
        """The member will not be measured (it failed, or failed correctness)."""
        self.withdrawn.add(name)

    def leave(self, name: str) -> None:
        """The member has used its load for the last time (or never will)."""
        self.withdraw(name)
        for step in ("setup", "training"):
            self.done[(name, step)].set()

    def finished(self, name: str) -> None:
        self.leave(name)
        self.done[(name, "finished")].set()

    async def last_out(self, name: str) -> None:
        """Members clean up in reverse order: a member may use an earlier member's load (two
        paths with the same load share one loaded instance, the reference's or a candidate's),
        so none unloads while a later member may still use it; the reference, whose host lock
        keeps other paths off the host, is last."""
        for m in self.members[self.members.index(name) + 1 :]:
            await self.done[(m, "finished")].wait()
