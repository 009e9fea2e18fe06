"""gRPC transport settings for the latency-critical hops (the router and the executor).
Imports no grpc: gRPC reads GRPC_EXPERIMENTS once, when it is first imported, so this runs
before that.

With gRPC's posix EventEngine endpoints (the default) every socket read hops to an
EventEngine thread and back through the completion queue to Python's poller thread; with them
off, the polling thread reads the socket itself. In development runs on this 2-core machine,
at one request at a time, the router and the executor each used about 15% less CPU per request
(from /proc) and the router added about 0.2 ms less at p50; benchmarks/bench_router.py compares the
router as deployed (this and uvloop) with one on stock settings in every run. An executor
serving one client at a time wakes about 6 threads a request instead of about 10 (voluntary
context switches from /proc), and its p50 fell by about 6% against the same executor on
gRPC's default (interleaved windows, docs/performance.md). Under 16 concurrent clients an
executor once served about 10% fewer requests/s this way; since batching engages under load,
the two served the same within the noise (0.995x, interleaved windows), so executors use it
too.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

LOW_LATENCY_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def prefer_low_latency() -> None:
    """Turn the EventEngine endpoints off for this process, unless the operator set
    GRPC_EXPERIMENTS (theirs wins) or grpc is already imported (too late: said in the log)."""
    if "GRPC_EXPERIMENTS" in os.environ:
        return
    if "grpc" in sys.modules:
        log.warning("grpc was imported before the transport was chosen: gRPC's default transport is used")
        return
    os.environ["GRPC_EXPERIMENTS"] = LOW_LATENCY_EXPERIMENTS
