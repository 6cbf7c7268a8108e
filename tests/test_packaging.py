"""Packaging: the generic top-level package names resolve to this project; the core needs no torch."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["planner", "cost_models", "profiles", "executors"])
def test_top_level_packages_are_ours(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(ROOT), module.__file__


def test_core_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import planner, cost_models, profiles, executors, planner.cli\n"
            "from planner import plan\n"
            "r = plan('llama3-8b', 'dgx-h100', 8, 16, 2048, top_k=1)\n"
            "assert r.plans\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_preset_yaml_is_package_data():
    import profiles

    assert (Path(profiles.__file__).parent / "models" / "llama3-70b.yaml").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"**/*.yaml"' in pyproject


DOCTEST_MODULES = ["cost_models.finetune", "cost_models.memory", "cost_models.units", "cost_models.compute", "cost_models.comm",
                   "cost_models.dispatch", "profiles.attention", "profiles.bundle", "profiles.frameworks",
                   "cost_models.layout", "cost_models.blocks", "planner.specs.strategy", "planner.specs.model", "planner.specs.hardware",
                   "planner.emit.megatron", "planner.emit.megatron_bridge", "profiles.gemm", "cost_models.sharding",
                   "cost_models.elementwise", "planner.error_band", "cost_models.step", "planner.space",
                   "cost_models.params", "executors.host_load", "cost_models.torus", "planner.goodput"]


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0, f"{module} is listed for doctests but has none"
    assert result.failed == 0


def test_every_module_with_doctests_is_listed():
    """A `>>>` example in a module outside DOCTEST_MODULES would never run."""
    found = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts)
                   for pkg in ("planner", "cost_models", "profiles", "executors")
                   for path in (ROOT / pkg).rglob("*.py") if ">>> " in path.read_text())
    assert found == sorted(DOCTEST_MODULES)


def test_benchmarks_stay_out_of_the_wheel():
    """benchmarks/ reads benchmarks/data in a source checkout: the installed
    packages must not ship it or import it (issue 7, part 6)."""
    import re

    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"include\s*=\s*\[([^\]]*)\]", pyproject).group(1)
    assert "benchmarks" not in include
    importers = [str(path.relative_to(ROOT)) for pkg in ("planner", "cost_models", "profiles", "executors")
                 for path in (ROOT / pkg).rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+benchmarks\b", path.read_text(), re.MULTILINE)]
    assert importers == []


#: Import name -> distribution name, where they differ.
DISTRIBUTIONS = {"yaml": "pyyaml"}
#: Optional packages (pyproject's extras): imported by the executors' torch workers or inside functions only.
OPTIONAL = {"torch", "megatron", "deepspeed", "colossalai", "transformer_engine", "apex", "triton", "matplotlib",
            "transformers", "torchtitan", "jax", "peft", "bitsandbytes"}
#: The tuner's dependency: a runtime dependency that only the executors and the CLI may import.
TUNER_ONLY = {"optuna"}


def _declared() -> list[str]:
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return sorted(re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps)


def test_pyproject_declares_exactly_what_the_installed_packages_import():
    """Every third-party module the installed packages import (at any level) is a declared dependency or an
    optional extra, and every declared dependency is imported."""
    import ast

    imported = set()
    for pkg in ("planner", "cost_models", "profiles", "executors"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    imported.add(node.module.split(".")[0])
    ours = {"planner", "cost_models", "profiles", "executors", "benchmarks"}
    third_party = {m for m in imported - ours - set(sys.stdlib_module_names) if m != "__future__"}
    assert sorted(DISTRIBUTIONS.get(m, m) for m in third_party - OPTIONAL) == _declared()


def test_only_the_executors_and_the_cli_import_the_tuners_dependencies():
    """optuna is installed with the planner but belongs to the tuner: nothing below the executors imports it,
    at the top or inside a function, so planning never pays for it."""
    import ast

    below = [path for pkg in ("planner", "cost_models", "profiles") for path in (ROOT / pkg).rglob("*.py")
             if not path.relative_to(ROOT).is_relative_to("planner/cli") and path.name != "__main__.py"]
    importers = []
    for path in below:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = {node.module.split(".")[0]}
            else:
                continue
            importers += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(names & TUNER_ONLY)]
    assert below, "no module of the planner core found"
    assert importers == []


def test_readme_lists_what_the_first_command_installs():
    import re

    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"The first line installs the planner \(([^;]*); no\s+torch\)", readme).group(1)
    assert sorted(name.strip().lower() for name in listed.replace("\n", " ").split(",")) == _declared()
