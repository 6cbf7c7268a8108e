"""The layers (issue #29): imports point down only, no import cycle between modules, and no in-function
import of the project's own modules below the executors and the CLI.

Bottom to top: planner.errors + planner.specs -> profiles -> cost_models -> planner core -> executors ->
CLI. The layers contract is pyproject.toml's import-linter contract, run here through import-linter;
the cycle and in-function checks read the sources with `ast` (import-linter checks neither).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "cost_models", "profiles", "executors")
#: Where an in-function import of the project's own modules is allowed: the top two layers, whose
#: modules import torch-bound code lazily (`executors`) or load commands on demand (`planner.cli`).
LAZY_OK = ("executors", "planner.cli", "planner.__main__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, known: set[str]) -> list[str]:
    """The project modules one import statement names (a `from package import name` naming a
    submodule counts as that submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def _imports() -> tuple[nx.DiGraph, list[tuple[str, str, int]]]:
    """The import graph of the project, in-function imports included (TYPE_CHECKING blocks left
    out: they never run), and every in-function import of a project module as (module, target, line)."""
    modules = _modules()
    known = set(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    local: list[tuple[str, str, int]] = []

    def visit(module: str, node: ast.AST, in_function: bool, is_package: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child, is_package, known):
                    if in_function:
                        local.append((module, target, child.lineno))
                    if target != module:
                        graph.add_edge(module, target)
            visit(module, child, function, is_package)

    for module, path in modules.items():
        visit(module, ast.parse(path.read_text(), str(path)), False, path.name == "__init__.py")
    return graph, local


def test_the_layers_contract_holds():
    """pyproject.toml's import-linter layers contract, as `lint-imports` runs it."""
    pytest.importorskip("importlinter")
    done = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command(['--no-cache']))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_no_import_cycle_between_modules():
    """Not even through an in-function import (a cycle held together by one still ties the modules)."""
    graph, _ = _imports()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []


def test_no_in_function_import_of_the_project_below_the_executors():
    _, local = _imports()
    below = [f"{m}:{line} imports {t}" for m, t, line in local if not m.startswith(LAZY_OK)]
    assert below == []


def test_the_checks_see_what_they_look_for():
    """The readers above find the imports they judge: the graph has module-level edges, and the
    executors' lazy imports are seen as in-function imports."""
    graph, local = _imports()
    assert graph.has_edge("planner.search", "cost_models.step")
    assert graph.has_edge("cost_models.arrays", "planner.specs.strategy")
    assert any(m.startswith("executors.") for m, _, _ in local)


def test_the_bottom_layer_imports_without_the_planner_core():
    """Importing the specs must not run the planner core (planner/__init__ resolves its names lazily)."""
    code = ("import sys; import planner.specs, planner.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cost_models', 'profiles', 'executors') "
            "or m in ('planner.api', 'planner.search')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
