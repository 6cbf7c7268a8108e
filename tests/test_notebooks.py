"""The notebooks under notebooks/: stored without outputs, and every cell runs top to bottom in a fresh kernel.

Each notebook is executed with nbclient in a kernel of this interpreter (a kernelspec written to a temporary
folder, so no `python` on PATH is needed), with the checkout first on PYTHONPATH and a temporary working
directory (nothing is written into the repository). The checks read what the executed notebook shows: the plan
table as HTML, the comparison's sentence, a PNG for every cell that draws.

Measured on a 2-core machine (pytest -s prints each time): quickstart.ipynb 32-47 s with the host's load (its CPU
validation and two-trial study take 25-35 s of it), moe_nvl72.ipynb about 11 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
#: Seconds one cell may take before the run fails (the quickstart's tuning study is the longest, ~25 s here).
CELL_TIMEOUT_S = 300
#: Name of the kernelspec written for the run.
KERNEL = "meshplan-test"



def _source_marker(cell, marker: str) -> bool:
    return cell.cell_type == "code" and marker in cell.source


def _kernel_folder(tmp_path: Path) -> Path:
    """A Jupyter data folder holding one kernelspec that runs this interpreter."""
    folder = tmp_path / "jupyter"
    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "meshplan test", "language": "python"}))
    return folder


def execute(name: str, tmp_path: Path, monkeypatch) -> tuple:
    """Run notebooks/<name> in a fresh kernel from a temporary folder; (executed notebook, seconds)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_folder(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("MPLBACKEND", "agg")
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(work)}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    seconds = time.monotonic() - start
    print(f"\n{name}: executed in {seconds:.1f} s")
    assert sorted(p.name for p in work.iterdir()) == [], "the notebook left files in its working folder"
    return nb, seconds


def outputs(nb, marker: str) -> list:
    """The outputs of the one code cell whose source holds `marker`."""
    cells = [c for c in nb.cells if _source_marker(c, marker)]
    assert len(cells) == 1, f"{len(cells)} cells hold {marker!r}"
    return cells[0].outputs


def pngs(nb, marker: str) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb, marker))


def html(nb, marker: str) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in outputs(nb, marker))


def text(nb, marker: str) -> str:
    return "".join(o.get("text", "") for o in outputs(nb, marker) if o.output_type == "stream")


def no_errors(nb) -> None:
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
            assert not (o.output_type == "stream" and o.name == "stderr"), o.text


@pytest.mark.parametrize("name", ["quickstart.ipynb", "moe_nvl72.ipynb"])
def test_stored_without_outputs(name):
    data = json.loads((NOTEBOOKS / name).read_text())
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert data["cells"][0]["cell_type"] == "markdown"
    nbformat.validate(nbformat.reads(json.dumps(data), as_version=4))


def test_notebooks_readme_lists_every_notebook():
    readme = (NOTEBOOKS / "README.md").read_text()
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == ["moe_nvl72.ipynb", "quickstart.ipynb"]
    for p in NOTEBOOKS.glob("*.ipynb"):
        assert p.name in readme


@pytest.mark.executor  # it validates and tunes with torchrun (gloo, CPU)
@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    nb, _ = execute("quickstart.ipynb", tmp_path, monkeypatch)
    no_errors(nb)
    table = html(nb, "result = plan(**question")
    assert "ranked plans" in table and "llama3-70b on 64 x" in table and "<td class=num>1</td>" in table
    assert "slower than #1" in html(nb, "best.compare(result.plans[1])")
    mine = html(nb, "comparison = best.compare(my_plan")
    assert "slower than #1" in mine or "slower than mine" in mine
    assert "nearest:" in text(nb, "rejected_by_reason(result)")
    for marker in ("plot_pareto()", "plot_breakdown(top=5)", "plot_memory(rank=1)", "plot_schedule(max_micro",
                   "report.plot()", "study.plot()"):
        assert pngs(nb, marker) >= 1, marker
    configs = text(nb, "for backend in (")
    assert "--tensor-model-parallel-size" in configs and '"train_micro_batch_size_per_gpu"' in configs
    assert "[training]" in configs
    validated = text(nb, "report = validate_plans(")
    assert ": ok" in validated and "loss parity passed" in validated
    tuned = text(nb, "study = tune(")
    assert "trials measured" in tuned and "fastest measured: dp" in tuned


@pytest.mark.slow
@pytest.mark.xdist_group("processes")  # a kernel process: run beside the other tests that start processes (conftest)
def test_moe_nvl72_runs(tmp_path, monkeypatch):
    nb, _ = execute("moe_nvl72.ipynb", tmp_path, monkeypatch)
    no_errors(nb)
    assert "deepseek-v3 on 1152 x" in html(nb, "result = plan(**question")
    assert "<th>ep</th>" in html(nb, "result = plan(**question")
    assert "level su" in text(nb, "topology_summary(cluster, graph)")
    where = text(nb, "best_est = where(best)")
    assert "plan 1: dp" in where and "  ep " in where and "priced on" in where
    assert pngs(nb, "draw_topology(cluster, graph") == 1
    assert "the MoE all-to-all" in html(nb, "inside.compare(across")
    placed = text(nb, "group_spans(p.strategy")
    assert "by rank arithmetic they cross" in placed
    for line in placed.splitlines():  # the explanation and the rank arithmetic agree on every layout
        priced_inside = "priced on nvlink5" in line
        assert priced_inside == line.rstrip().endswith("cross: nothing"), line
    racks = text(nb, "for gpus in (1024, 1152)")
    assert "1,024 GPUs, 64 per rack" in racks and "1,152 GPUs, 72 per rack" in racks
    on_1024, on_1152 = racks.split("1,152 GPUs")
    assert "ep groups on nvlink5" in on_1024 and "ep groups on ndr-infiniband across nvlink-domain" in on_1152
    assert "slower than 1,024 GPUs" in html(nb, "for gpus in (1024, 1152)")
    dispatchers = text(nb, 'for dispatcher in ("alltoall"')
    assert all(d in dispatchers for d in ("alltoall", "deepep", "hybridep"))
    for marker in ("plot_pareto()", "plot_breakdown(top=5)", "plot_memory(rank=1)", "plot_schedule(rank=1"):
        assert pngs(nb, marker) >= 1, marker
    assert "<th>cp</th>" in html(nb, "long_result = plan(")
    assert "per step" in html(nb, "no_cp = plan(")
