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


DOCTEST_MODULES = ["cost_models.memory", "cost_models.units", "cost_models.compute", "cost_models.comm",
                   "cost_models.dispatch",
                   "cost_models.attention_kernels",
                   "cost_models.layout", "cost_models.blocks", "planner.specs.strategy", "planner.specs.model",
                   "planner.emit.megatron", "cost_models.gemm_tables", "cost_models.sharding",
                   "cost_models.elementwise", "planner.error_band", "cost_models.step", "planner.space"]


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
