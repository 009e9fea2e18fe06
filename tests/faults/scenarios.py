"""The faults, each run under load on a `Cluster` and measured the same way: one function per
fault returns its `Figures`, which the tests assert and `python -m benchmarks.faults` prints.

Each scenario: load from the client host for a fixed time, the fault injected after a warm-up
and healed a fixed time later, then the ledger read once every answered request is in it
(bounded). Every figure is counted on the client (answers by request id, errors by status)
or read from the router's log and spool directory; none is taken from the router's own word.
The windows are the tests' (`Pace()` and each fault's own length), as short as each claim
allows (each says why); `python -m benchmarks.faults` passes its longer ones.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.faults.cluster import Cluster
from tests.router.small_disk import fill, small_disk

CLIENTS = 6


@dataclass(frozen=True)
class Pace:
    """How long the load runs around a fault: `warm_s` before it, `after_s` after the heal.

    3 s warm: the p99 before the fault is taken over its last `warm_s - 1` s (the first second
    is the load's own start), 2 s of a closed loop of `CLIENTS` callers: 600-1,000 answers on
    a loaded 2-core host, so the p99 is the 6th slowest or further in, not one outlier.
    1 s after: every recovery figure but the client's own latency (`SETTLING`) is polled past
    the load's end (a log line, the spool's samples), so the load after the heal only shows
    that requests are answered again."""

    warm_s: float = 3.0
    after_s: float = 1.0


# A recovery judged by the client's latency needs answers a whole `settled_at` window (1 s)
# after the heal, and room for the settling itself: the load goes on 3 s after the heal.
SETTLING = Pace(after_s=3.0)


@dataclass(frozen=True)
class Figures:
    fault: str
    requests: int  # answers + errors the client saw
    errors: int
    errors_in_fault: int  # errors of requests sent while the fault lasted
    p99_fault_ms: float  # p99 latency of the answers to requests sent during the fault
    p99_before_ms: float
    eject_s: float | None  # fault start -> the router ejected / noticed (from its log)
    recover_s: float | None  # heal -> re-admitted / delivered
    answered: int  # distinct request ids the client received
    ledger_jobs: int  # completed primary jobs in the ledger
    doubled: int  # jobs recorded more than once
    unanswered_jobs: int  # jobs in the ledger with no answer at the client
    spool_peak: int  # segments waiting on the router's disk, at most, during the fault
    dead_letters: int
    error_codes: dict[str, int] = field(default_factory=dict)  # the client's errors by status

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _spool_watch(cluster: Cluster, stop: threading.Event, seen: list[tuple[float, int]]) -> None:
    while not stop.wait(0.1):
        seen.append((time.time(), cluster.spool_counts()[0]))


def spool_drained(healed: float, seen: list[tuple[float, int]]) -> float | None:
    """When the spool was empty again after the heal (None: never, within the watch)."""
    return next((t for t, n in seen if t >= healed and n == 0), None)


def run_fault(
    cluster: Cluster,
    name: str,
    inject: Callable[[], None],
    heal: Callable[[], None],
    noticed: str,
    recovered: Callable[[float, list[tuple[float, int]]], float | None] | None,
    fault_s: float,
    pace: Pace,
    routers: tuple[str, ...] = ("router",),
    hold_s: float | None = None,
) -> Figures:
    """`noticed`: the log line (of the first of `routers`, where the load goes) that says it
    saw the fault; `recovered`: when it had
    recovered, from the heal's time and the spool's (time, segments) samples (None: when the
    client's latency settled again, at most twice the p99 before the fault, or 50 ms more);
    the fault lasts `fault_s` under the load's `pace` (with `hold_s`: until `hold_s` after
    the router logged `noticed`, `fault_s` at most)."""
    warm_s = pace.warm_s
    earlier = set(cluster.completed_jobs(set(), timeout_s=0))  # a cluster shared by faults
    load = cluster.load(CLIENTS, seconds=warm_s + fault_s + pace.after_s, routers=routers)
    stop, samples = threading.Event(), [(time.time(), 0)]
    watcher = threading.Thread(target=_spool_watch, args=(cluster, stop, samples), daemon=True)
    watcher.start()
    try:
        time.sleep(warm_s)
        cut = time.time()
        inject()
        _wait_out_fault(cluster, routers[0], noticed, cut, fault_s, hold_s)
    finally:
        heal()
    healed = time.time()
    if hold_s is not None:  # the load was started for the longest fault: `after_s` from the heal
        time.sleep(pace.after_s)
        Cluster.end_load(load)
    got = Cluster.result(load, 90)
    answered = {rid for _, _, rid in got.answers}
    jobs = {k: n for k, n in cluster.completed_jobs(answered, timeout_s=60).items() if k not in earlier}
    drained_by = time.monotonic() + 30  # the ledger has it all; the spool's files go next
    while cluster.spool_counts()[0] and time.monotonic() < drained_by:
        time.sleep(0.1)
    time.sleep(0.2)  # one more sample of the watcher
    stop.set()
    watcher.join(5)
    seen = cluster.logged_at(routers[0], noticed, cut)
    before = got.p99_ms(cut - warm_s + 1, cut)
    back = (
        got.settled_at(healed, max(2 * before, before + 50))
        if recovered is None
        else recovered(healed, samples)
    )
    return Figures(
        fault=name,
        requests=len(got.answers) + len(got.errors),
        errors=len(got.errors),
        errors_in_fault=sum(1 for a, _, _ in got.errors if cut <= a < healed),
        p99_fault_ms=round(got.p99_ms(cut, healed), 1),
        p99_before_ms=round(before, 1),
        eject_s=None if seen is None else round(seen - cut, 2),
        recover_s=None if back is None else round(back - healed, 2),
        answered=len(answered),
        ledger_jobs=len(jobs),
        doubled=sum(1 for n in jobs.values() if n > 1),
        unanswered_jobs=len(set(jobs) - answered),
        spool_peak=max(n for _, n in samples),
        dead_letters=cluster.spool_counts()[1],
        error_codes=dict(Counter(code for _, _, code in got.errors)),
    )


def _wait_out_fault(
    cluster: Cluster, role: str, noticed: str, cut: float, fault_s: float, hold_s: float | None
) -> None:
    """Returns when the fault is to be healed: `fault_s` after the inject, or with `hold_s`
    that long after `role` logged `noticed` (polled), whichever comes first."""
    end = time.monotonic() + fault_s
    if hold_s is not None:
        while cluster.logged_at(role, noticed, cut) is None and time.monotonic() < end:
            time.sleep(0.1)
        end = min(end, time.monotonic() + hold_s)
    time.sleep(max(0.0, end - time.monotonic()))


def executor_blackhole(cluster: Cluster, fault_s: float = 3.0, pace: Pace = Pace()) -> Figures:
    """exec-b's link down (every packet dropped, no RST) for `fault_s`, then up. 3 s: longer
    than the eject bound the test holds it to (2.0 s + 0.7 s), so an ejection the fault ends
    too soon for would have failed the bound anyway; a longer blackhole only lengthens the
    cooldown the re-admission waits out (it doubles per ejection, and a silent host is
    ejected again each time its cooldown ends: 6.7 s to re-admit after 4 s, 2.5 s after 3 s)."""
    host = cluster.hosts["exec-b"]
    return run_fault(
        cluster, "executor blackhole", host.blackhole, host.heal,
        r"ejected deployment b",
        lambda healed, _: _logged_within(cluster, "router", r"re-admitted deployment b", healed, 15.0),
        fault_s, pace,
    )  # fmt: skip


def _logged_within(cluster: Cluster, role: str, pattern: str, after: float, timeout_s: float) -> float | None:
    """When `role` logged `pattern` after `after`, waiting up to `timeout_s` for the line: the
    router re-admits a healed host at its next passing probe, which may come after the load."""
    deadline = time.monotonic() + timeout_s
    while (at := cluster.logged_at(role, pattern, after)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return at


def metering_partition(cluster: Cluster, seconds: float = 5.0, pace: Pace = Pace()) -> Figures:
    """The metering host cut off from the router (its link down) for `seconds` (the issue's
    spec is 30 s; the test uses 5 s, the benchmark takes `--partition-s`), then healed: the
    router answers from its auth cache, spools usage, and delivers it once the link is back.
    5 s is past the auth cache's TTL (2 s) plus a lookup's timeout (2 s, metering_client.py),
    so requests are answered from a stale identity before the heal (with `auth_stale_s` at
    0.5 s the 5 s partition had 1,002 UNAVAILABLE), and past a flush's timeout (2 s), so
    usage spools for seconds."""
    host = cluster.hosts["metering"]
    return run_fault(
        cluster, f"router-metering partition {seconds:.0f} s", host.blackhole, host.heal,
        r"metering unreachable", spool_drained, seconds, pace,
    )  # fmt: skip


def slow_lossy_link(
    cluster: Cluster, delay_ms: float = 200.0, loss: float = 0.05, fault_s: float = 4.0, pace: Pace = SETTLING
) -> Figures:
    """The router's link to exec-b given `delay_ms` each way and `loss` for `fault_s`, then
    healed. The relay models loss as TCP sees it: a lost segment is retransmitted after the
    sender's minimum RTO, so a `loss` share of the chunks (and those behind them) arrive
    200 ms later; nothing is corrupted or reset (link_proxy.py). Probes then take 400-800 ms,
    inside the 1 s health timeout: b stays admitted, and least-loaded routing sends it less.
    4 s, not shorter: the claim is that none of the probes in it fails (three or four)."""
    return run_fault(
        cluster, f"link {delay_ms:.0f} ms, {loss:.0%} loss", lambda: cluster.link(delay_ms, loss),
        cluster.link, r"deployment b: health check failed", None, fault_s, pace,
    )  # fmt: skip


def postgres_restart(cluster: Cluster, down_s: float = 3.0, pace: Pace = Pace()) -> Figures:
    """The ledger's PostgreSQL stopped (`pg_ctl stop -m fast`: every session ended, as a
    restart or a failover does) and started again `down_s` later. Metering answers UNAVAILABLE
    while it cannot write; the router spools, and delivers once metering writes again."""
    return run_fault(
        cluster, f"postgres restart ({down_s:.0f} s down)", cluster.pg.stop, cluster.pg.start,
        r"metering unreachable", spool_drained, down_s, pace,
    )  # fmt: skip


def router_and_metering_killed(cluster: Cluster, down_s: float = 2.0, pace: Pace = Pace()) -> Figures:
    """Two routers and two metering replicas on one ledger (`Cluster(replicas=True)`), the
    load spread over both routers: `router` and `metering-b` SIGKILLed at once, crosswise (the
    surviving router-b loses its first metering), then both restarted `down_s` later, the router
    on its own spool directory (its journal replayed). The client moves to the other router when
    one fails; router-b's channel moves to metering. 2 s down: both moves are at once, the
    replay is on the restart, and the restarts add some 2 s of their own (each service's
    imports) before either serves again. `eject_s`: when router-b first spooled after the kill
    (None: its channel moved to metering before a flush failed)."""

    def kill() -> None:
        cluster.kill("router")
        cluster.kill("metering-b")

    def restart() -> None:
        cluster.start_metering("metering-b")
        cluster.start_router()

    return run_fault(
        cluster, "router + metering-b SIGKILLed", kill, restart,
        r"metering unreachable|recovered \d+ usage events", spool_drained, down_s, pace,
        routers=("router-b", "router"),
    )  # fmt: skip


def spool_disk_full(
    cluster: Cluster,
    disk_kb: int = 768,
    room_kb: int = 48,
    fault_s: float = 8.0,
    pace: Pace = Pace(),
    hold_s: float | None = 1.0,
) -> Figures:
    """The router restarted with its spool on a tmpfs of `disk_kb` of its own (a 64 KiB
    reserve), then under load: metering cut off (so the spool must hold usage) and the disk
    filled by another writer but for `room_kb`, which the spool's journal and segments take. The
    router must refuse new requests (RESOURCE_EXHAUSTED), answer only what it journaled, and
    serve again once healed (the filler removed, the link up). Then back on its own spool.
    The fault lasts until `hold_s` after the router logged its refusal, `fault_s` at most (None:
    `fault_s`): how soon the load fills `room_kb` is the host's (the refusal came 0.8-1.0 s
    after the fill here, 3.45 s with a core taken by a busy loop), and 1 s of refusals (each
    answered at once) is hundreds of them, for `errors_in_fault`."""
    small, saved = cluster.directory / "spool-small", dict(cluster.router_settings)
    host, filler, healing = cluster.hosts["metering"], small / "filler", list[float]()

    def inject() -> None:
        host.blackhole()
        fill(small, "filler")
        with filler.open("r+b") as f:  # `room_kb` back: the spool fills it itself
            f.truncate(max(0, f.seek(0, 2) - room_kb * 1024))

    def heal() -> None:
        healing.append(time.time())
        host.heal()
        filler.unlink(missing_ok=True)

    def served_again(healed: float, _: list[tuple[float, int]]) -> float | None:
        """When the router took requests again: it may be before `healed` is stamped (the
        disk has room the moment the filler goes), never before the heal began."""
        at = _logged_within(cluster, "router", r"serving metered requests again", healing[0], 15.0)
        return None if at is None else max(at, healed)

    cluster.stop("router")
    try:
        with small_disk(small, disk_kb):
            cluster.spool_dir, cluster.router_settings = small, {**saved, "spool_reserve_kb": 64}
            cluster.start_router()
            try:
                return run_fault(
                    cluster, "spool disk full", inject, heal, r"refusing new metered requests",
                    served_again, fault_s, pace, hold_s=hold_s,
                )  # fmt: skip
            finally:
                cluster.stop("router")  # before the unmount: it holds files there
    finally:
        cluster.spool_dir, cluster.router_settings = None, saved
        cluster.start_router()


FAULTS: dict[str, Callable[..., Figures]] = {  # each: (cluster, its windows as keywords)
    "executor-blackhole": executor_blackhole,
    "metering-partition": metering_partition,
    "slow-lossy-link": slow_lossy_link,
    "postgres-restart": postgres_restart,
    "spool-disk-full": spool_disk_full,
    "router-metering-kill": router_and_metering_killed,  # last: it kills and restarts two services
}
