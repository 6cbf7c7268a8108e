"""Tables are data: `profiles` reads every table the cost model uses (GEMM, attention, element-wise,
collectives, memory, dispatch, frameworks) into typed objects that travel with the GPU
(`GpuSpec.tables`, profiles/bundle.py); the cost model reads no file and caches nothing by a table's name."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import yaml

from cost_models.arrays import StrategyArrays
from cost_models.step import evaluate_arrays
from planner import Strategy, evaluate
from planner.errors import SpecError
from planner.specs import ClusterSpec, TrainSpec
from profiles import PROFILES_DIR, load_cluster, load_model
from profiles.tables import kernel_table

ROOT = Path(__file__).resolve().parent.parent
DENSE = dict(model="llama3-8b", num_gpus=16, global_batch_size=64, seq_len=4096,
             strategy=dict(tp=2, dp=8, micro_batch_size=1))
MOE = dict(model="qwen3-30b-a3b", cluster="gb200-nvl72", num_gpus=8, global_batch_size=512, seq_len=4096,
           moe_dispatcher="hybridep", moe_load_imbalance=1.0,
           strategy=dict(ep=8, micro_batch_size=4, zero_stage=1, recompute="none"))


def _scaled(values, factor):
    return [v * factor for v in values]


def _slower_gemm(doc, factor=0.5):
    doc["rows"] = [row[:4] + _scaled(row[4:], factor) for row in doc["rows"]]


def _slower_collectives(doc, factor=0.5):
    for ops in doc["tiers"].values():
        for rows in ops.values():
            for row in rows:
                row["busbw_gb_per_s"] = _scaled(row["busbw_gb_per_s"], factor)


def _slower_attention(doc):
    for curve in doc["curves"]:
        curve["tflops"] = _scaled(curve["tflops"], 0.5)


def _slower_elementwise(doc):
    doc["hbm_fraction"] *= 0.5


def _more_memory(doc):
    doc["cuda_context_mib"] += 4096


def _slower_dispatch(doc):
    for dispatcher in ("deepep", "hybridep"):
        for rows in (doc.get(dispatcher) or {}).values():
            for row in rows:
                for key in [k for k in row if k.endswith(("_torch", "_kernel"))]:
                    row[key] *= 0.5


def _override(root: Path, topic: str, name: str, edit, factor=None) -> None:
    """A copy of the shipped table `topic` of set `name` (a `same_as` file resolved into the table it names)
    under `root`, changed by `edit`, under the same name."""
    doc = copy.deepcopy(kernel_table(topic, name))
    doc.pop("same_as", None)
    doc.pop("alias_of", None)
    edit(doc) if factor is None else edit(doc, factor)
    path = root / "kernels" / topic / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))


def _reduce_every_microbatch(root: Path) -> None:
    """frameworks/megatron.yaml with the gradients reduced after every micro-batch's backward."""
    doc = yaml.safe_load((PROFILES_DIR / "frameworks" / "megatron.yaml").read_text())
    doc["grad_reduce_each_microbatch"] = {0: "always", 1: "always", 2: "always"}
    path = root / "frameworks" / "megatron.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))


def _figures(est) -> tuple:
    return est.step_time_s, est.peak_memory_bytes, tuple(sorted(est.time_s.items()))


def test_two_versions_of_a_table_under_one_name_in_one_process(tmp_path, monkeypatch):
    """Clusters loaded from two profile roots that hold different GEMM and collective tables for the same set
    (h100-sxm) each keep their own; neither sees the other's, whatever MESHPLAN_PROFILES says when it runs;
    a table changed in place is read again."""
    monkeypatch.delenv("MESHPLAN_PROFILES", raising=False)
    shipped = load_cluster("dgx-h100")
    base = evaluate(cluster=shipped, **DENSE)
    slow = tmp_path / "slow"
    _override(slow, "gemm", "h100-sxm", _slower_gemm)
    _override(slow, "collectives", "h100-sxm", _slower_collectives)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(slow))
    slowed = load_cluster("dgx-h100")
    assert slowed == shipped and slowed.model_dump() == shipped.model_dump()  # the same spec, other tables
    est_slow = evaluate(cluster=slowed, **DENSE)
    assert est_slow.time_s["compute"] > base.time_s["compute"]
    assert est_slow.time_s["tp_comm"] > base.time_s["tp_comm"]
    assert _figures(evaluate(cluster=shipped, **DENSE)) == _figures(base)  # the first cluster kept its tables
    assert _figures(evaluate(cluster="dgx-h100", **DENSE)) == _figures(est_slow)
    monkeypatch.delenv("MESHPLAN_PROFILES")
    assert _figures(evaluate(cluster="dgx-h100", **DENSE)) == _figures(base)  # not the other root's stale table
    # the same file rewritten: a new version, read again
    _override(slow, "gemm", "h100-sxm", _slower_gemm, 0.25)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(slow))
    assert evaluate(cluster="dgx-h100", **DENSE).time_s["compute"] > est_slow.time_s["compute"]


def test_the_user_profiles_directory_overrides_a_table(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHPLAN_PROFILES", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "nowhere"))
    base = evaluate(cluster="dgx-h100", **DENSE)
    _override(tmp_path / "data" / "meshplan" / "profiles", "gemm", "h100-sxm", _slower_gemm)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert evaluate(cluster="dgx-h100", **DENSE).time_s["compute"] > base.time_s["compute"]


OVERRIDES = {
    "gemm": lambda root: _override(root, "gemm", "gb200", _slower_gemm),
    "attention": lambda root: _override(root, "attention", "gb200", _slower_attention),
    "elementwise": lambda root: _override(root, "elementwise", "gb200", _slower_elementwise),
    "collectives": lambda root: _override(root, "collectives", "gb200", _slower_collectives),
    "memory": lambda root: _override(root, "memory", "gb200", _more_memory),
    "dispatch": lambda root: _override(root, "dispatch", "gb200", _slower_dispatch),
    "frameworks": _reduce_every_microbatch,
}


@pytest.mark.parametrize("topic", sorted(OVERRIDES))
def test_a_user_copy_of_every_table_applies(tmp_path, monkeypatch, topic):
    """A MESHPLAN_PROFILES root with a changed copy of one table (the GPU's kernel table of that topic, or
    Megatron's framework profile) changes the estimate of a plan that uses it."""
    monkeypatch.delenv("MESHPLAN_PROFILES", raising=False)
    base = evaluate(**MOE)
    OVERRIDES[topic](tmp_path)
    monkeypatch.setenv("MESHPLAN_PROFILES", str(tmp_path))
    changed = evaluate(**MOE)
    if topic == "memory":
        assert changed.peak_memory_bytes > base.peak_memory_bytes
    elif topic == "dispatch":
        assert changed.time_s["ep_comm"] > base.time_s["ep_comm"]
    elif topic == "frameworks":
        assert changed.time_s["dp_comm"] > base.time_s["dp_comm"]
    else:
        assert changed.step_time_s > base.step_time_s
    monkeypatch.delenv("MESHPLAN_PROFILES")
    assert _figures(evaluate(**MOE)) == _figures(base)


def test_a_hand_built_cluster_resolves_its_tables_at_the_api():
    shipped = load_cluster("dgx-h100")
    by_hand = ClusterSpec(**shipped.model_dump())
    assert by_hand == shipped and not by_hand.gpu.has_tables
    assert _figures(evaluate(cluster=by_hand, **DENSE)) == _figures(evaluate(cluster=shipped, **DENSE))
    st = StrategyArrays.from_strategies([Strategy(tp=2, dp=8).resolve(16)])
    train = TrainSpec(global_batch_size=64, seq_len=4096)
    with pytest.raises(SpecError, match="not resolved"):  # the cost model itself reads no file
        evaluate_arrays(load_model("llama3-8b"), by_hand, train, st)
    copied = shipped.model_copy(update={"gpu": shipped.gpu.model_copy(update={"kernel_tables": None})})
    with pytest.raises(SpecError, match="kernel_tables None"):  # a copy naming another set is not stale
        evaluate_arrays(load_model("llama3-8b"), copied, train, st)


# ---- layering: the cost model reads no file ----------------------------------------------------
#: The typed-table modules of profiles, the only ones cost_models may import.
TYPED = {"profiles.attention", "profiles.collectives", "profiles.dispatch", "profiles.elementwise",
         "profiles.frameworks", "profiles.gemm", "profiles.memory"}
#: Modules that read or find files.
FILE_READERS = {"pathlib", "os", "io", "yaml", "json", "shutil", "glob", "importlib.resources",
                "planner.specs.files", "profiles", "profiles.files", "profiles.tables", "profiles.bundle"}


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _imports(tree):
    """(module imported, the node) of every import statement, relative ones resolved to absolute names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node
            yield from ((f"{node.module}.{alias.name}", node) for alias in node.names)


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines |= {n.lineno for child in node.body for n in ast.walk(child) if hasattr(n, "lineno")}
    return lines


def test_cost_models_import_no_file_reader_and_open_no_file():
    problems = []
    for path, tree in _modules("cost_models"):
        where = path.relative_to(ROOT)
        for name, node in _imports(tree):
            top = name.split(".")[0]
            if name in FILE_READERS and (name != "profiles" or isinstance(node, ast.Import)):
                problems.append(f"{where}:{node.lineno} imports {name}")
            elif top == "profiles" and name != "profiles" and not any(
                    name == t or name.startswith(f"{t}.") for t in TYPED):
                problems.append(f"{where}:{node.lineno} imports {name} (not a typed-table module)")
            elif top == "planner" and not name.startswith(("planner.errors", "planner.specs")):
                problems.append(f"{where}:{node.lineno} imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called in ("open", "read_text", "read_bytes", "safe_load", "load_path", "read_yaml"):
                    problems.append(f"{where}:{node.lineno} calls {called}")
    assert problems == []


def test_typed_table_modules_read_no_file():
    """The typed-table modules that cost_models may import are data and lookups only."""
    problems = []
    for module in sorted(TYPED):
        path = ROOT / (module.replace(".", "/") + ".py")
        for name, node in _imports(ast.parse(path.read_text())):
            if name in FILE_READERS or (name.startswith("profiles.") and not any(
                    name == t or name.startswith(f"{t}.") for t in TYPED)):
                problems.append(f"{module}:{node.lineno} imports {name}")
    assert problems == []


@pytest.mark.parametrize("package", ["cost_models", "profiles"])
def test_no_function_local_import_of_the_project(package):
    project = ("cost_models", "planner", "profiles", "executors", "benchmarks")
    problems = []
    for path, tree in _modules(package):
        skip = _type_checking_lines(tree)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for name, node in _imports(fn):
                    if name.split(".")[0] in project and node.lineno not in skip:
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name} inside {fn.name}")
    assert problems == []
