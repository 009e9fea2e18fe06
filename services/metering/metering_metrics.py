"""Metering's Prometheus metrics: usage ingest (events by outcome, ingest lag) and the
ledger writer's queue.

Ingest lag is how long after a request ended its usage event reached the ledger (now minus
the event's `ended_unix_us`): a router whose spool holds events while metering was down shows
up here as a lag, and its depth as `switchyard_router_spool_depth` on that router.

- `switchyard_metering_usage_events_total{outcome}`: accepted, duplicate, unpriced.
- `switchyard_metering_usage_batches_total`: RecordUsage calls kept.
- `switchyard_metering_ingest_lag_seconds` (histogram, per event), and
  `switchyard_metering_last_ingest_lag_seconds` (gauge, the largest of the last batch).
- `switchyard_metering_write_queue_depth` (gauge): calls waiting for the ledger's writer.
- `switchyard_metering_audit_integrity_failures_total`: anchor checks that failed (writes halt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from switchyard.metrics_endpoint import CallbackCollector, Histogram, counter, gauge

LAG_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class MeteringStats:
    def __init__(self) -> None:
        self.events = {"accepted": 0, "duplicate": 0, "unpriced": 0}
        self.batches = 0
        self.lag = Histogram(LAG_BUCKETS_S)
        self.last_lag_s = 0.0

    def ingested(self, ended_unix_us: Iterable[int], accepted: int, duplicates: int, unpriced: int) -> None:
        now_us = time.time_ns() // 1000
        worst = 0.0
        for ended in ended_unix_us:
            if ended > 0:
                lag = max(0.0, (now_us - ended) / 1e6)
                self.lag.observe((), lag)
                worst = max(worst, lag)
        self.last_lag_s = worst
        self.batches += 1
        self.events["accepted"] += accepted
        self.events["duplicate"] += duplicates
        self.events["unpriced"] += unpriced


def collector(
    stats: MeteringStats, write_queue: Callable[[], int], integrity_failures: Callable[[], int] = lambda: 0
) -> CallbackCollector:
    def families() -> Iterable[Any]:
        events = counter("switchyard_metering_usage_events_total", "Usage events received", ("outcome",))
        for outcome, n in stats.events.items():
            events.add((outcome,), n)
        batches = counter("switchyard_metering_usage_batches_total", "RecordUsage calls kept", ())
        batches.add((), stats.batches)
        last = gauge("switchyard_metering_last_ingest_lag_seconds", "Largest lag of the last batch", ())
        last.add_metric([], stats.last_lag_s)
        queue = gauge("switchyard_metering_write_queue_depth", "Calls waiting for the ledger writer", ())
        queue.add_metric([], write_queue())
        lag = stats.lag.family(
            "switchyard_metering_ingest_lag_seconds", "From a request's end to its usage in the ledger", ()
        )
        failures = counter(
            "switchyard_metering_audit_integrity_failures_total",
            "Audit anchor checks that failed (the ledger then refuses writes)",
            (),
        )
        failures.add((), integrity_failures())
        return (events, batches, lag, last, queue, failures)

    return CallbackCollector(families)
