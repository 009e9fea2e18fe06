"""What the tests of a whole local cluster with both executors (`switchyard up`, `demo`) share."""

from __future__ import annotations

from pathlib import Path


def xla_cluster_config(tmp: Path, xla_python: str) -> Path:
    """A switchyard.toml in `tmp` (state under `tmp / "state"`): every service on a free
    port, the cpu and the xla executor (under `xla_python`) serving mlp and tiny-lm, and a
    quarter of the traffic shadowed."""
    path = tmp / "switchyard.toml"
    path.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nshadow_share = 0.25\n"
        '[executors.cpu]\nport = 0\nmodels = ["mlp", "tiny-lm"]\n'
        f'[executors.xla]\nenabled = true\nport = 0\nmodels = ["mlp", "tiny-lm"]\npython = "{xla_python}"\n'
    )
    return path
