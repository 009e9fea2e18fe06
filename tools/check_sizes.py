"""List classes over --class-lines and functions over --function-lines (the size rule).

    python tools/check_sizes.py [--class-lines 220] [--function-lines 70] [FOLDER ...]

The folders default to every product folder: services/, workflows/, clients/ and
switchyard/; generated code (switchyard/gen) and the migrations are not read. A size is the
definition's span in the file, decorators and docstring included, from its first line to its
last. Prints one row per definition over the limit and exits 1 when there is any; `make lint`
runs it. A class over the limit is cut where its responsibilities part, never into mixins.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PRODUCT = ("services", "workflows", "clients", "switchyard")
SKIPPED = ("gen", "migrations", "__pycache__")


def oversized(path: Path, class_lines: int, function_lines: int) -> Iterator[tuple[int, str, str, int]]:
    """(line, kind, qualified name, lines) for each definition in `path` over its limit."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                size = (child.end_lineno or child.lineno) - first + 1
                is_class = isinstance(child, ast.ClassDef)
                if size > (class_lines if is_class else function_lines):
                    yield first, "class" if is_class else "function", prefix + child.name, size
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--class-lines", type=int, default=220)
    parser.add_argument("--function-lines", type=int, default=70)
    parser.add_argument("folders", nargs="*", default=list(PRODUCT))
    args = parser.parse_args(argv)
    found = 0
    for folder in args.folders:
        for path in sorted(Path(folder).rglob("*.py")):
            if any(part in SKIPPED for part in path.parts):
                continue
            for line, kind, name, size in oversized(path, args.class_lines, args.function_lines):
                print(f"{path}:{line}: {kind} {name}: {size} lines")
                found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
