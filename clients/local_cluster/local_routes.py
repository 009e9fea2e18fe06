"""The router configuration `switchyard up` derives from the executors it starts.

Every model is pinned to the CPU executor (the reference path) and, where the XLA executor
runs and serves the model too, a share of its requests is mirrored there as shadow traffic,
so the evaluator sees both paths' answers for the same inputs. A `router.routes_file` in the
cluster config replaces this with the operator's own routes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from clients.local_cluster.plan import ServiceSpec

# The path name each backend's executor is charged under in the ledger, with `@<host>` added
# as a trial does (the demo trial names its paths the same), so request and trial costs of a
# path land on the same rows.
PATH_IDS = {"cpu": "cpu-eager", "cuda": "cuda-eager", "xla": "xla", "tpu": "tpu-strict"}
PRIMARY_ORDER = ("cuda", "cpu", "tpu", "xla")
SHADOW_ORDER = ("xla", "tpu", "cpu")


def _toml_value(value: object) -> str:
    # JSON strings, numbers and booleans are valid TOML for the simple values used here.
    return json.dumps(value)


def path_id(backend: str, host: str) -> str:
    """The ledger path of a backend's executor: `<path name>@<host>`, as a trial names it."""
    name = PATH_IDS.get(backend, backend)
    return f"{name}@{host}" if host else name


def render_routes(
    executors: Mapping[str, ServiceSpec],
    shadow_share: float,
    settings: Mapping[str, object] | None = None,
    paths: Mapping[str, str] | None = None,
) -> str:
    """The router's TOML: [router] settings, one [deployments.X] per executor, [routes.M]."""
    lines = [
        "# Written by `switchyard up` from the executors it started; set the cluster config's",
        "# router.routes_file to use your own.",
        "[router]",
    ]
    for key, value in (settings or {}).items():
        lines.append(f"{key} = {_toml_value(value)}")
    for backend, spec in executors.items():
        lines += [
            "",
            f"[deployments.{backend}]",
            f"address = {_toml_value(spec.address)}",
            f"path = {_toml_value((paths or {}).get(backend) or PATH_IDS.get(backend, backend))}",
        ]
    models: dict[str, list[str]] = {}
    for backend, spec in executors.items():
        for model in spec.models:
            models.setdefault(model, []).append(backend)
    for model, backends in models.items():
        primary = next(b for b in (*PRIMARY_ORDER, *backends) if b in backends)
        lines += [
            "",
            f"[routes.{_toml_value(model)}]",
            'policy = "pinned"',
            f"targets = [{_toml_value(primary)}]",
        ]
        shadows = [b for b in SHADOW_ORDER if b in backends and b != primary]
        if shadows and shadow_share > 0:
            lines += [
                "",
                f"[routes.{_toml_value(model)}.shadow]",
                f"share = {shadow_share}",
                f"candidates = [{', '.join(_toml_value(b) for b in shadows[:1])}]",
            ]
    return "\n".join(lines) + "\n"


def write_default_routes(
    path: Path,
    executors: Mapping[str, ServiceSpec],
    shadow_share: float,
    settings: Mapping[str, object] | None = None,
    paths: Mapping[str, str] | None = None,
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_routes(executors, shadow_share, settings, paths), encoding="utf-8")
    return path
