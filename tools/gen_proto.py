"""Generate Python code and typed stubs from proto/ into switchyard/gen (the one pinned command).

The generated modules register their descriptors in a private pool (switchyard.gen._pool)
instead of protobuf's default pool: tritonclient registers its own copy of the
``inference.*`` messages in the default pool, and two copies of one symbol there collide.
The wire format is unaffected, so tritonclient and our servers still speak to each other.

Usage: python tools/gen_proto.py [--check]
  --check  generate into a temporary folder and fail if the committed code differs.
"""

from __future__ import annotations

import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
GEN_DIR = ROOT / "switchyard" / "gen"
BIN = Path(sys.executable).parent
PACKAGES = ("inference", "switchyard.v1")

POOL_MODULE = '''"""The private descriptor pool all generated switchyard modules register in."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
'''


def _rewrite(text: str) -> str:
    for package in PACKAGES:
        escaped = re.escape(package)
        text = re.sub(rf"^from {escaped} import", f"from switchyard.gen.{package} import", text, flags=re.M)
        # mypy-protobuf (and the builder call) name other modules by their full dotted name.
        text = re.sub(rf"(?<![\w.]){escaped}\.(\w+_pb2)", rf"switchyard.gen.{package}.\1", text)
    text = text.replace(
        "from google.protobuf import descriptor_pool as _descriptor_pool",
        "from switchyard.gen import _pool",
    )
    return text.replace("_descriptor_pool.Default()", "_pool.POOL")


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out.rglob("*.py*"):
        path.write_text(_rewrite(path.read_text()))
    for folder in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    (out / "__init__.py").write_text('"""Generated from proto/ by tools/gen_proto.py; do not edit."""\n')
    (out / "_pool.py").write_text(POOL_MODULE)
    (out / "py.typed").touch()


def _differences(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    diffs = sorted(str(p) for p in files_a ^ files_b)
    diffs += sorted(str(p) for p in files_a & files_b if not filecmp.cmp(a / p, b / p, shallow=False))
    return diffs


def main() -> int:
    if "--check" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            diffs = _differences(Path(tmp), GEN_DIR)
        if diffs:
            print("generated code is stale; run `make proto`:", *diffs, sep="\n  ")
            return 1
        print("generated code is up to date")
        return 0
    shutil.rmtree(GEN_DIR, ignore_errors=True)
    GEN_DIR.mkdir(parents=True)
    generate(GEN_DIR)
    print(f"generated {GEN_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
