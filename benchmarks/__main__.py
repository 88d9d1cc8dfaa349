"""`python -m benchmarks`: list the benchmarks; `python -m benchmarks <name> [args]` runs one.

`python -m benchmarks.<name> [args]` runs the same script. A benchmark is a module of this
package with a `__main__` block; the others (harness, model_shapes, ...) are its helpers.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent


def runnable() -> dict[str, str]:
    """{name: the first line of its docstring} of every benchmark, read without importing."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        source = path.read_text()
        if '__name__ == "__main__"' not in source:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def main(argv: list[str]) -> int:
    benchmarks = runnable()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m benchmarks <name> [args]   (or python -m benchmarks.<name>)\n")
        width = max(map(len, benchmarks))
        for name, summary in benchmarks.items():
            print(f"  {name:<{width}}  {summary}")
        return 0
    name = argv[0]
    if name not in benchmarks:
        print(f"no benchmark {name!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    sys.argv = [f"benchmarks.{name}", *argv[1:]]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
