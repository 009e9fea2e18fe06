"""Faults a network makes, each under load on a cluster laid across hosts: one table.

`python -m benchmarks.faults` (as root: it makes network namespaces) starts the cluster of
tests/faults/cluster.py (PostgreSQL, two metering replicas, two executors, two routers and a
load client, each on a host of its own, mTLS between them), runs each fault of
tests/faults/scenarios.py in turn on it and prints, per fault: the client's requests and
errors, p99 before and during the fault, the time to eject (or notice) and to recover, the
ledger's jobs against the answers received (equal, none doubled), the spool's peak and the
dead letters. The JSON goes to `--out`.

The router<->metering partition lasts `--partition-s` (30 s, the issue's figure; the test
uses 5 s). Delay and loss go through a userspace relay on the router's link to exec-b, since
this kernel has no sch_netem (tests/faults/link_proxy.py says what its loss models).
The spool disk fault mounts a 768 KiB tmpfs for the router's spool (restarting the router
onto it and back); its refusals are RESOURCE_EXHAUSTED, counted in `errors`.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.faults import postgres
from tests.faults.cluster import Cluster
from tests.faults.netns import Network, unavailable
from tests.faults.scenarios import FAULTS, Figures, Pace

# Longer windows than the tests': 5 s of load before each fault (a p99 over 4 s), 3 s after,
# and each fault as long as the runbook's table has it (the partition: --partition-s).
PACE = Pace(warm_s=5.0, after_s=3.0)
WINDOWS: dict[str, dict[str, Any]] = {
    "executor-blackhole": {"fault_s": 4.0},
    "slow-lossy-link": {"fault_s": 4.0},
    "postgres-restart": {"down_s": 3.0},
    "spool-disk-full": {"fault_s": 8.0, "hold_s": None},
    "router-metering-kill": {"down_s": 4.0},
}

COLUMNS = (
    ("fault", "fault", 32),
    ("requests", "requests", 9),
    ("errors", "errors", 7),
    ("p99_before_ms", "p99 before ms", 14),
    ("p99_fault_ms", "p99 fault ms", 13),
    ("eject_s", "eject s", 8),
    ("recover_s", "recover s", 10),
    ("ledger_jobs", "ledger jobs", 12),
    ("answered", "answers", 8),
    ("doubled", "doubled", 8),
    ("spool_peak", "spool peak", 11),
    ("dead_letters", "dead", 5),
)


def table(rows: list[Figures]) -> str:
    lines = ["".join(title.ljust(width) for _, title, width in COLUMNS)]
    for row in rows:
        values = row.as_json()
        lines.append("".join(str(values[key]).ljust(width) for key, _, width in COLUMNS))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--partition-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("out/bench/faults.json"))
    args = parser.parse_args()
    why = unavailable() or postgres.unavailable()
    if why:
        raise SystemExit(f"cannot make hosts here: {why}")
    windows = {**WINDOWS, "metering-partition": {"seconds": args.partition_s}}
    runs: dict[str, Callable[[Cluster], Figures]] = {
        name: functools.partial(fault, pace=PACE, **windows[name]) for name, fault in FAULTS.items()
    }
    rows: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="switchyard-faults-") as scratch:
        cluster = Cluster(Network(), Path(scratch), replicas=True)
        try:
            cluster.start()
            for name in args.faults:
                rows.append(runs[name](cluster))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            cluster.close()
    print(table(rows))
    exact = all(r.ledger_jobs == r.answered and not r.doubled and not r.unanswered_jobs for r in rows)
    print("ledger equal to the answers received:", "yes, every fault" if exact else "NO")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"faults": [r.as_json() for r in rows], "exact": exact}, indent=2))


if __name__ == "__main__":
    main()
