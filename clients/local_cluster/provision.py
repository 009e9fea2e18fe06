"""What `switchyard up` sets up once the back ends are healthy, before router and worker start.

- the ledger path id of each executor (its backend and host, from Describe) and, unless the
  config names a routes file, the router's default routes (`routes.toml` in the state dir);
- the example price book, once per state directory, so a trial on a plain cluster reaches a
  cost verdict (finance replaces it with `switchyard prices set`);
- the key of the principal that trials started from the Temporal UI run as (mTLS only).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clients.local_cluster import health, plan
from clients.local_cluster import local_routes as routes
from clients.local_cluster.cluster_config import Config
from clients.local_cluster.demo_finance import CURRENCY, LOCAL_PRICES, ensure_prices
from clients.local_cluster.plan import ServiceSpec
from clients.local_cluster.principal_keys import create_principal_key
from switchyard.gen.switchyard.v1 import metering_pb2

UI_PRINCIPAL = "temporal-ui"


@dataclass(frozen=True)
class Provisioning:
    config: Config
    state_dir: Path
    executors: dict[str, ServiceSpec]  # backend -> its executor
    metering: str  # addresses
    evaluator: str
    say: Callable[[str], None]

    async def run(self, paths: dict[str, str]) -> None:
        """Fills `paths` (backend -> ledger path id) and sets up what needs the back ends."""
        await self._write_routes(paths)
        await self._ensure_example_prices(paths)
        if self.config.worker_enabled and not self.config.security.insecure:
            await self._ensure_ui_key()

    async def _ensure_example_prices(self, paths: dict[str, str]) -> None:
        """The example price book (demo_finance.LOCAL_PRICES), set once per state directory so
        a trial on a plain cluster reaches a cost verdict; finance replaces it with `switchyard
        prices set`, and a later `up` on the same state leaves their prices alone."""
        marker = self.state_dir / "example-prices"
        if marker.exists():
            return
        executors = {backend: spec.address for backend, spec in self.executors.items()}
        await ensure_prices(self.metering, executors, paths)
        marker.write_text("example price book set by switchyard up; see docs/trial-spec.md\n")
        book = ", ".join(f"{b} {LOCAL_PRICES.get(b, 120_000) / 1e6:g}/h" for b in executors)
        self.say(f"EXAMPLE price book in force ({CURRENCY} {book}): replace it with `switchyard prices set`")

    async def _ensure_ui_key(self) -> None:
        """The principal trials started from the Temporal UI run as (`temporal-ui`, trials:run
        on every model) and its key for the worker, made once per state directory; the operator
        revokes or narrows it like any key (`switchyard roles`, `switchyard keys`)."""
        path = plan.ui_key_file(self.state_dir)
        if path.exists():
            return
        actor = metering_pb2.Actor(source="switchyard up")
        grants = [("trials:run", "*")]
        made = await create_principal_key(  # existing_ok: its key file went, so a new key of it
            self.metering, UI_PRINCIPAL, grants, actor, kind="service", existing_ok=True
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(made.key)
        self.say(f"trials started from the Temporal UI run as principal {UI_PRINCIPAL!r} (key in {path})")

    async def _write_routes(self, paths: dict[str, str]) -> None:
        """Once the executors are up: their ledger path ids (host from Describe) and routes."""
        for backend, spec in self.executors.items():
            paths[backend] = routes.path_id(backend, await health.executor_host(spec.address))
        if self.config.router.routes_file:
            return
        settings = {"spool_dir": str(self.state_dir / "spool"), "evaluator": self.evaluator}
        routes.write_default_routes(
            self.state_dir / "routes.toml", self.executors, self.config.router.shadow_share, settings, paths
        )
