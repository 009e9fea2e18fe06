"""`switchyard demo`, what `make run` runs: the cluster up, then the main job end to end.

The main job (`run_main_job`) only needs the services' addresses: a team principal and key,
a few hundred requests through the router with `tritonclient.grpc` (a share mirrored to the
XLA path), one `tiny-lm-gen` completion streamed through the router's OpenAI API with the
`openai` client, a `tiny-lm` trial cpu-eager vs xla to its verdict, and the finance report
from the ledger. What it measured also goes to `reports/main-job.json`, which is how the
end-to-end test (tests/cluster/test_main_job.py) reads a `demo --keep` run as `make run` starts it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clients.local_cluster import demo_finance as finance
from clients.local_cluster import demo_generation as gen_demo
from clients.local_cluster import demo_trial as trials
from clients.local_cluster import health
from clients.local_cluster.cluster_config import Config
from clients.local_cluster.local_routes import PATH_IDS
from clients.local_cluster.traffic import TeamKey, TrafficResult, create_team_key, send_requests
from clients.local_cluster.up import format_table, serve_until_stopped, started

if TYPE_CHECKING:
    from workflows.temporal_link import TemporalLink


@dataclass(frozen=True)
class DemoOptions:
    keep: bool = False
    requests: int = 300
    concurrency: int = 8


@dataclass(frozen=True)
class Endpoints:
    """Where the main job finds the cluster (from LocalCluster or cluster.json)."""

    router: str
    metering: str
    temporal: str
    namespace: str
    task_queue: str
    executors: Mapping[str, str]  # backend -> address
    paths: Mapping[str, str]  # backend -> ledger path id
    models: Mapping[str, tuple[str, ...]]  # backend -> models it serves
    temporal_ui: str = ""
    openai_url: str = ""  # the router's OpenAI API base URL ("" = off)
    # TLS and codec key file paths as the worker's environment (workflows/temporal_link.py)
    temporal_env: Mapping[str, str] = field(default_factory=dict)

    def link(self) -> TemporalLink:
        from workflows.temporal_link import TemporalLink

        return TemporalLink.from_env(self.temporal, self.namespace, env=self.temporal_env)

    @classmethod
    def from_state(cls, state: Mapping[str, object], namespace: str = "default",
                   task_queue: str = "switchyard-trials") -> Endpoints:  # fmt: skip
        services = state["services"]
        assert isinstance(services, dict)
        temporal = str(state.get("temporal_address") or services["temporal"]["address"])
        return cls(
            router=services["router"]["address"],
            metering=services["metering"]["address"],
            temporal=temporal,
            namespace=namespace,
            task_queue=task_queue,
            executors={
                name.removeprefix("executor-"): s["address"]
                for name, s in services.items()
                if name.startswith("executor-")
            },
            paths={
                name.removeprefix("executor-"): s.get("path") or PATH_IDS[name.removeprefix("executor-")]
                for name, s in services.items()
                if name.startswith("executor-")
            },
            models={
                name.removeprefix("executor-"): tuple(s.get("models", ()))
                for name, s in services.items()
                if name.startswith("executor-")
            },
            temporal_ui=str(state.get("temporal_ui", "")),
            openai_url=str(state.get("openai_url", "")),
            temporal_env=dict(state.get("temporal_env") or {}),  # type: ignore[call-overload]
        )


@dataclass
class MainJobResult:
    team: TeamKey
    traffic: list[TrafficResult] = field(default_factory=list)
    trial: trials.TrialOutcome | None = None
    finance: list[finance.PathCost] = field(default_factory=list)
    reports: dict[str, Path] = field(default_factory=dict)
    shadow: list[str] = field(default_factory=list)
    after_trial: list[TrafficResult] = field(default_factory=list)
    generation: gen_demo.StreamedCompletion | None = None
    wall_s: float = 0.0


MODELS = ("mlp", "tiny-lm")  # the tensor models the job sends traffic to


def _split(total: int, models: list[str]) -> dict[str, int]:
    share = {m: total // len(models) for m in models}
    share[models[0]] += total - sum(share.values())
    return share


async def run_main_job(
    ep: Endpoints,
    out_dir: Path,
    requests: int = 300,
    concurrency: int = 8,
    tell: Callable[[str], None] = print,
) -> MainJobResult:
    """The whole job against a running cluster; returns what it measured."""
    began = time.monotonic()
    run = uuid.uuid4().hex[:8]
    window_start_us = int(time.time() * 1_000_000)
    await finance.ensure_prices(ep.metering, ep.executors, ep.paths)

    team = await create_team_key(ep.metering, f"team-demo-{run}", trials=("tiny-lm",))
    tell(f"team principal {team.team} ({team.principal_id}) with key id {team.key_id} and role infer")
    result = MainJobResult(team)
    await _serving_window(ep, result, run, window_start_us, requests, concurrency, tell)
    result.shadow = await shadow_report(ep.router, team.key)
    for row in result.shadow:
        tell(f"shadow {row}")

    if "xla" in ep.executors and "cpu" in ep.executors:
        await _trial(ep, result, out_dir, run, concurrency, tell)
    else:
        tell("trial skipped: it needs the CPU and the XLA executor (make setup-xla)")

    result.finance = await finance.report(ep.metering, window_start_us)
    result.reports["finance"] = await finance.write_html(
        ep.metering, out_dir / "finance.html", window_start_us
    )
    result.wall_s = time.monotonic() - began
    result.reports["result"] = write_result(result, out_dir / "main-job.json")
    return result


def write_result(result: MainJobResult, path: Path) -> Path:
    """What the main job measured, as JSON for scripts and CI: `result`'s fields, its team by
    name and key id (never the key)."""
    body = asdict(result)
    body["team"] = {"team": result.team.team, "key_id": result.team.key_id}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1, default=str), encoding="utf-8")
    return path


async def _serving_window(
    ep: Endpoints,
    result: MainJobResult,
    run: str,
    window_start_us: int,
    requests: int,
    concurrency: int,
    tell: Callable[[str], None],
) -> None:
    """Tensor traffic on each model and one streamed completion, inside reserved windows."""
    key = result.team.key
    reservations = await finance.open_reservations(ep.metering, ep.paths, run, window_start_us)
    try:
        for model, count in _split(requests, list(MODELS)).items():
            traffic = await send_requests(ep.router, key, model, count, concurrency, seed=len(result.traffic))
            result.traffic.append(traffic)
            tell(
                f"{model}: {traffic.ok}/{traffic.sent} ok through the router in {traffic.wall_s:.1f}s "
                f"({concurrency} in flight), p50 {traffic.p(50):.1f} ms, p99 {traffic.p(99):.1f} ms, "
                f"router's own p50 {traffic.overhead_p50_us():.0f} us; answered by {traffic.answered_by}"
                + (f"; errors {traffic.errors}" if traffic.errors else "")
            )
        result.generation = await gen_demo.demo_generation(ep.openai_url, key, ep.models, tell)
        # Mirrored requests finish after the callers' answers and usage reaches the ledger in
        # batches: the window closes only once all of it has landed (a closed reservation's
        # cost is final, so later usage inside it would be refused).
        await quiesce(ep, key, window_start_us, tell)
    finally:
        # The serving window ends here, also when the traffic failed: an open reservation
        # would hold the paths, and the trial reserves the same paths for itself.
        await finance.close_reservations(ep.metering, reservations)


async def _trial(
    ep: Endpoints,
    result: MainJobResult,
    out_dir: Path,
    run: str,
    concurrency: int,
    tell: Callable[[str], None],
) -> None:
    """tiny-lm's trial of xla against cpu-eager, then proof that serving went on after it."""
    tell("trial: tiny-lm on cpu-eager (reference) vs xla, on Temporal (TrialWorkflow)")
    team = result.team
    spec = trials.demo_spec(team.team)
    outcome = await trials.run_trial(
        ep.link(),
        ep.task_queue,
        out_dir,
        f"demo-tiny-lm-{run}",
        spec,
        tell,
        metering=ep.metering,
        api_key=team.key,  # the team holds trials:run on tiny-lm
    )
    result.trial = outcome
    result.reports.update(outcome.reports)
    # Serving goes on after a trial (it hands back each executor's serving set-up): a few
    # requests per model through the router prove it.
    for model in MODELS:
        after = await send_requests(
            ep.router, team.key, model, 16, concurrency, seed=100 + len(result.traffic)
        )
        result.after_trial.append(after)
        tell(
            f"{model} after the trial: {after.ok}/{after.sent} ok"
            + (f"; errors {after.errors}" if after.errors else "")
        )


def _causes(exc: BaseException) -> str:
    import grpc

    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 6:
        if isinstance(seen, grpc.aio.AioRpcError):
            parts.append(f"{seen.code().name}: {seen.details()}")
        else:
            parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__
    return " <- ".join(parts)


async def _shadow_stats(router: str, key: str) -> list[Any]:
    import grpc

    from switchyard.gen.switchyard.v1 import router_pb2, router_pb2_grpc

    async with grpc.aio.insecure_channel(router) as channel:
        reply = await router_pb2_grpc.RouterAdminStub(channel).ShadowReport(
            router_pb2.ShadowReportRequest(), metadata=[("authorization", f"Bearer {key}")], timeout=10
        )
    return list(reply.stats)


async def quiesce(
    ep: Endpoints, key: str, since_us: int, tell: Callable[[str], None], timeout_s: float = 60.0
) -> None:
    """Waits until no request is inside any executor and the router's shadow counts and the
    ledger's totals stay the same for a second."""
    deadline = time.monotonic() + timeout_s
    previous: object = None
    while time.monotonic() < deadline:
        loads = [await health.executor_load(address) for address in ep.executors.values()]
        shadow = [(s.model, s.candidate, s.pairs, s.failures) for s in await _shadow_stats(ep.router, key)]
        ledger = [
            (r.path, r.jobs_completed, r.jobs_failed) for r in await finance.report(ep.metering, since_us)
        ]
        snapshot = (loads, shadow, ledger)
        if snapshot == previous and all(load in ((0, 0), None) for load in loads):
            return
        previous = snapshot
        await asyncio.sleep(1.0)
    tell(f"note: traffic still landing after {timeout_s:.0f}s; closing the serving window anyway")


async def shadow_report(router: str, key: str) -> list[str]:
    """The router's shadow comparisons: pairs compared and how far the candidate diverged."""
    stats = await _shadow_stats(router, key)
    return [
        f"{s.model} -> {s.candidate}: {s.pairs} pairs compared by the {s.comparer}, {s.diverged} diverged, "
        f"{s.failures} candidate errors, max abs error {s.max_abs_error:.3g}, min cosine {s.min_cosine:.6f}"
        for s in stats
    ]


def print_summary(result: MainJobResult, ep: Endpoints) -> None:
    print()
    if result.trial is not None:
        t = result.trial
        print(f"trial {t.trial_id}: {t.status}; reference {t.report.get('reference', '?')}")
        for path, verdict in sorted(t.verdicts.items()):
            print(f"  {path}: {verdict}")
            for reason in t.reasons.get(path, []):
                print(f"    {reason}")
    print()
    print("finance report (this run's window; money in the ledger's currency)")
    print(finance.format_table(result.finance))
    print()
    if ep.temporal_ui:
        print(f"Temporal UI:   {ep.temporal_ui}  (workflow type TrialWorkflow, task queue {ep.task_queue})")
    for name, report_path in sorted(result.reports.items()):
        print(f"{name + ' report:':<14} {report_path}")
    print(f"main job took {result.wall_s:.1f}s")


async def demo(config: Config, options: DemoOptions) -> int:
    began = time.monotonic()
    async with started(config) as cluster:
        if cluster.stop_event.is_set():
            return 130
        print(format_table(await cluster.status()), flush=True)
        state = json.loads((cluster.state_dir / "cluster.json").read_text())
        ep = Endpoints.from_state(state, config.temporal.namespace, config.temporal.task_queue)
        job = asyncio.ensure_future(
            run_main_job(ep, cluster.state_dir / "reports", options.requests, options.concurrency)
        )
        stopper = asyncio.ensure_future(cluster.stop_event.wait())
        await asyncio.wait({job, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()
            print("interrupted: stopping the cluster")
            return 130
        stopper.cancel()
        failure = job.exception()
        if failure is not None:
            # Say what failed and why in a few lines; the cause chain carries the service's
            # message (e.g. an activity's FAILED_PRECONDITION), the logs the rest.
            print(f"main job failed: {_causes(failure)}", file=sys.stderr)
            print(f"service logs: {cluster.state_dir / 'logs'}", file=sys.stderr)
            return 1
        print_summary(job.result(), ep)
        print(f"demo finished in {time.monotonic() - began:.1f}s (cluster start included)")
        if options.keep:
            return await serve_until_stopped(cluster)
        return 0
