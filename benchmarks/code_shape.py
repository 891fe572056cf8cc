"""The shape of the package, for a closing note or a review: modules and their lines, the largest
classes and functions, and the import circles (``tests/test_layout.py`` holds the limits).

    python benchmarks/code_shape.py            # this tree
    python benchmarks/code_shape.py --top 12   # more rows
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_layout import MODULES, PACKAGE, circles, imports  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    lines: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        lines.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef):
                classes.append((size, f"{name}.{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((size, f"{name}.{node.name}"))
    top_level = [n for n, path in MODULES.items() if path.parent == PACKAGE and path.name != "__init__.py"]
    graph = {name: imports(path) - {name} for name, path in MODULES.items()}
    total = sum(n for n, _ in lines)
    print(f"{len(MODULES)} modules, {len(top_level)} of them beside the packages, {total} lines")
    for title, rows in (("modules", lines), ("classes", classes), ("functions", functions)):
        print(f"largest {title}:")
        for size, name in sorted(rows, reverse=True)[: args.top]:
            print(f"  {size:5d}  {name}")
    print(f"import circles: {circles(graph) or 'none'}")


if __name__ == "__main__":
    main()
