"""The shadow mirror: a sampled share of a route's requests sent again to candidate deployments.

The caller always gets the primary answer; the copy runs afterwards in a background task,
bounded by `shadow_max_pending` (a copy that would exceed it is skipped and counted, so
shadowing can never slow the primary path down without limit). Each pair is judged by the
evaluator service when one is configured and up, else locally (`shadow_divergence.divergence`), and the
statistics per route and candidate are kept for RouterAdmin.ShadowReport. Every copy is
metered as its own usage event on the candidate's path (arm "shadow", tagged with the
primary's request id, the candidate and the comparison), so a trial can see what shadowing
cost and what it found.

A generative model's copy (streamed, or unary) is compared by the trial's divergence rule
(`switchyard.judge.divergence.judge_pair`): tokens equal up to the first divergence, each
side's token in the other's top-k there; the first diverging position goes into the statistics. Only
greedy requests are mirrored (a sampled one may differ by design; it is counted as sampled,
and no copy is sent).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.router.evaluator_client import EvaluatorComparer, EvaluatorUnavailable
from services.router.request_records import Charge, CopySender, Outcome, UsageRecorder, now_us
from services.router.router_config import Settings, Target
from services.router.shadow_divergence import ShadowStats, divergence, greedy_request, is_generation
from switchyard.errors import SwitchyardError, UpstreamError
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.judge.divergence import judge_pair
from switchyard.judge.oip_generations import generated
from switchyard.judge.output_divergence import Divergence

log = logging.getLogger(__name__)


class ShadowMirror:
    def __init__(
        self,
        forwarder: CopySender,
        meter: UsageRecorder,
        settings: Settings,
        evaluator: EvaluatorComparer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.forwarder = forwarder
        self.meter = meter
        self.settings = settings
        self.evaluator = evaluator
        self.rng = rng or random.Random()
        self.stats: dict[tuple[str, str], ShadowStats] = {}  # (route model, candidate label)
        self._pending = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def offer(self, charge: Charge, raw: bytes, primary: bytes, time_remaining: float | None) -> None:
        """Mirrors the request to each candidate of the route, for its sampled share."""
        self._spawn(charge, lambda c, s: self._one(charge, raw, primary, time_remaining, c, s))

    def offer_generation(
        self, charge: Charge, raw: bytes, primary: list[pb.ModelInferResponse], time_remaining: float | None
    ) -> None:
        """Mirrors a completed streamed generation (its responses as the caller got them)."""
        self._spawn(charge, lambda c, s: self._one_generation(charge, raw, primary, time_remaining, c, s))

    def _spawn(
        self, charge: Charge, work: Callable[[Target, ShadowStats], Coroutine[Any, Any, None]]
    ) -> None:
        shadow = charge.route.shadow
        if shadow is None or self.rng.random() >= shadow.share:
            return
        for candidate in shadow.candidates:
            key = (charge.route.model, candidate.label(charge.route.model))
            stats = self.stats.setdefault(key, ShadowStats(*key))
            if self._pending >= self.settings.shadow_max_pending:
                stats.skipped += 1
                continue
            self._pending += 1
            task = asyncio.create_task(work(candidate, stats))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one_generation(
        self,
        charge: Charge,
        raw: bytes,
        primary: list[pb.ModelInferResponse],
        time_remaining: float | None,
        candidate: Target,
        stats: ShadowStats,
    ) -> None:
        if not greedy_request(pb.ModelInferRequest.FromString(raw)):
            stats.sampled += 1  # sampled tokens may differ by design: not mirrored, not charged
            self._pending -= 1
            return

        async def pair(outcome: Outcome, tags: dict[str, str], budget: float) -> None:
            answers = self.forwarder.stream_on(candidate, charge.header, raw, budget, outcome)
            mirrored = [response async for response in answers]
            self._judge_generation(stats, tags, generated(primary), generated(mirrored))

        await self._metered(charge, time_remaining, candidate, stats, pair)

    async def _one(
        self,
        charge: Charge,
        raw: bytes,
        primary: bytes,
        time_remaining: float | None,
        candidate: Target,
        stats: ShadowStats,
    ) -> None:
        first = pb.ModelInferResponse.FromString(primary)
        if is_generation(first) and not greedy_request(pb.ModelInferRequest.FromString(raw)):
            stats.sampled += 1  # a sampled generation answered unary: not mirrored, not charged
            self._pending -= 1
            return

        async def pair(outcome: Outcome, tags: dict[str, str], budget: float) -> None:
            reply = await self.forwarder.forward_copy(candidate, charge.header, raw, budget, outcome)
            if is_generation(first):  # a generative model answered unary: the divergence rule
                answer = pb.ModelInferResponse.FromString(reply)
                self._judge_generation(stats, tags, generated([first]), generated([answer]))
                return
            d, comparer = await self._compare(first, pb.ModelInferResponse.FromString(reply))
            stats.comparer = comparer
            stats.add(d)
            tags.update(
                max_abs_error=repr(d.max_abs_error),
                cosine=repr(d.cosine),
                diverged=str(d.diverged).lower(),
                comparer=comparer,
            )

        await self._metered(charge, time_remaining, candidate, stats, pair)

    async def _metered(
        self,
        charge: Charge,
        time_remaining: float | None,
        candidate: Target,
        stats: ShadowStats,
        pair: Callable[[Outcome, dict[str, str], float], Awaitable[None]],
    ) -> None:
        """Runs one shadow copy (`pair`: send it, judge the pair); counts its failure, and meters
        it on the candidate's path (arm "shadow", tagged with the judgement or the error)."""
        outcome = Outcome(path=self.forwarder.path_of(candidate))
        copy = Charge(charge.route, charge.identity, charge.request_id, charge.header, now_us())
        tags: dict[str, str] = {"shadow_of": charge.request_id, "candidate": stats.candidate}
        try:
            budget = self.settings.default_timeout_s if time_remaining is None else max(time_remaining, 1.0)
            await pair(outcome, tags, budget)
        except UpstreamError as exc:
            stats.failures += 1
            tags["error"] = exc.status.value
        except (SwitchyardError, ValueError, KeyError) as exc:
            stats.failures += 1
            tags["error"] = f"comparison failed: {exc}"
        finally:
            self._pending -= 1
            self.meter.record(copy, outcome, "shadow", tags)

    @staticmethod
    def _judge_generation(stats: ShadowStats, tags: dict[str, str], primary: Any, mirrored: Any) -> None:
        d = judge_pair(primary, mirrored)
        stats.comparer = "generation"
        stats.add_generation(d)
        tags.update(
            first_divergence=str(d.first_divergence),
            diverged=str(d.checked and not d.passed).lower(),
            comparer="generation" if d.checked else "generation-unchecked",
        )

    async def _compare(
        self, primary: pb.ModelInferResponse, candidate: pb.ModelInferResponse
    ) -> tuple[Divergence, str]:
        """The evaluator's judgement when one is configured and up; the local comparison otherwise."""
        if self.evaluator is not None:
            try:
                return await self.evaluator.compare(primary, candidate), "evaluator"
            except EvaluatorUnavailable as exc:
                log.warning("evaluator unreachable (%s): comparing the shadow pair locally", exc)
        d = divergence(primary, candidate, self.settings.shadow_atol, self.settings.shadow_rtol)
        return d, "local"

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.evaluator is not None:
            await self.evaluator.close()
