"""The judge library stays pure: importing every module of it loads no grpc, no generated
protobuf module and nothing from the folders above switchyard/ (docs/architecture.md#who-judges-what)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
import switchyard.judge as judge
for m in pkgutil.iter_modules(judge.__path__):
    importlib.import_module("switchyard.judge." + m.name)
roots = ("grpc", "google.protobuf", "switchyard.gen", "services", "workflows", "clients")
print(sorted(m for m in sys.modules if m.split(".")[0] in roots or m.startswith(roots)))
"""


def test_the_judge_imports_no_grpc_no_protobuf_and_no_service() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
