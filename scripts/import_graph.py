"""The import graph of a package's own modules, and its cycles (strongly connected components of more than one).

    python scripts/import_graph.py [PACKAGE_DIR] [--edges]      e.g. python scripts/import_graph.py gateway --edges

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions included: a module that needs another
one's names only for its annotations still depends on it. Read from the source (``ast``), nothing is imported. Exits
1 when a cycle remains. ``tests/test_layout.py`` runs it on ``gateway``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package in ``package_dir`` (``__init__`` is the package)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``."""
    modules = module_names(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.ImportFrom) and node.level:  # relative: from the module's own package
                base = name.rsplit(".", node.level if path.name != "__init__.py" else node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(target for target in targets if target in modules and target != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="gateway", type=Path)
    parser.add_argument("--edges", action="store_true", help="list every module's imports of the package")
    args = parser.parse_args(argv)
    graph = import_graph(args.package.resolve())
    if args.edges:
        for name in sorted(graph):
            print(f"{name} -> {', '.join(sorted(graph[name])) or '(none)'}")
    found = cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports of each other, {len(found)} cycle(s)")
    for component in found:
        print(f"  a cycle of {len(component)}:")
        for name in component:
            print(f"    {name} -> {', '.join(sorted(graph[name] & set(component)))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
