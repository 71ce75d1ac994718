"""The product package's modules import each other without a cycle (``scripts/import_graph.py``): the routes see the
whole of the lifespan's state and pass on what a call needs, so no module below them climbs back up."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from procs import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "import_graph.py"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gateway_package_has_no_import_cycle() -> None:
    graph_tool = load_script()
    graph = graph_tool.import_graph(REPO_ROOT / "gateway")
    assert graph_tool.cycles(graph) == []
    # Nothing below the routes reaches the lifespan's state (the service locator the cycle came from).
    users = {name for name, imports in graph.items() if "gateway.state" in imports}
    assert users <= {"gateway.app", *(name for name in graph if name.startswith("gateway.routes."))}, users


def imported_packages(package: Path) -> set[str]:
    """The top-level names every module of ``package`` imports (absolute imports, wherever they are)."""
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_the_simulator_is_a_sibling_of_the_product() -> None:
    """The SGLang simulator (a development tool) lives beside the gateway, not inside it: neither imports the other."""
    assert not (REPO_ROOT / "gateway" / "simulator").exists()
    assert "sglang_sim" not in imported_packages(REPO_ROOT / "gateway")
    assert "gateway" not in imported_packages(REPO_ROOT / "sglang_sim")


def test_the_cycle_finder_finds_one(tmp_path: Path) -> None:
    """The check above could not fail if the finder missed cycles: a package of three modules in a ring, one of the
    imports only for annotations, is one."""
    package = tmp_path / "ring"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from ring.b import B\n")
    (package / "b.py").write_text("from ring import c\nB = 1\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ring.a import A\n")
    (package / "d.py").write_text("from . import a\n")
    graph_tool = load_script()
    graph = graph_tool.import_graph(package)
    assert graph["ring.d"] == {"ring", "ring.a"}
    assert graph_tool.cycles(graph) == [["ring.a", "ring.b", "ring.c"]]
