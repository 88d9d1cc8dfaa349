"""Structure of the package, checked over its source (ast, nothing imported):

- the import graph of atom/ has no circle, counting every import (a function-level import
  that only hides a circle is still one);
- no `ATOM_*` environment read outside atom/envs.py (configuration is read in one place);
- no test imports the `benchmarks` package (measurement sits beside the product; what tests
  and benchmarks share lives under tests/ or in the product).

The known-exception lists below are empty; an entry that no longer applies fails the test,
so that it is removed. The benchmarks' own tests (benchmarks/tests/) may import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Known exceptions: none (issue 31 removed the last); a new one needs a reason here.
KNOWN_CIRCLES: list[list[str]] = []
KNOWN_ENV_READERS: set[str] = set()
KNOWN_BENCHMARK_IMPORTERS: set[str] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "atom").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the atom modules it imports anywhere in its body}. `from p import x` counts
    as importing p.x when that is a module, else p."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
        deps = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_circle_finder_sees_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_atom():
    assert circles(import_graph()) == sorted(sorted(c) for c in KNOWN_CIRCLES)


def _environment_reads(tree: ast.AST):
    """Keys of os.environ.get / os.getenv / environ.get / os.environ[...] reads: the literal
    key, or None when the key is computed (it could be an ATOM_ name)."""
    for node in ast.walk(tree):
        key_node = None
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "getenv") and node.args:
                key_node = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in (
            "os.environ",
            "environ",
        ):
            if isinstance(node.ctx, ast.Load):
                key_node = node.slice
        if key_node is not None:
            is_literal = isinstance(key_node, ast.Constant) and isinstance(key_node.value, str)
            yield key_node.value if is_literal else None


def test_atom_environment_read_only_in_envs():
    readers = set()
    for path in (ROOT / "atom").rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "atom/envs.py":
            continue
        for key in _environment_reads(ast.parse(path.read_text())):
            if key is None or key.startswith("ATOM_"):
                readers.add(relative)
    assert readers == KNOWN_ENV_READERS


def test_tests_do_not_import_benchmarks():
    offenders = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                offenders.add(path.relative_to(ROOT).as_posix())
    assert offenders == KNOWN_BENCHMARK_IMPORTERS
