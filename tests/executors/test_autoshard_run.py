"""Auto-parallel plans run with DTensor on CPU gloo ranks, each step's loss against one process
(executors.autoshard_run). The plans are written by hand for the test models (tests/autoshard/models.py):
Megatron-style tensor parallelism and data parallelism for small_gpt, data parallelism for small_cnn, a 2 x 2 mesh
on four ranks, and a channel-sharded convolution that DTensor cannot run (refused, never rewritten)."""

from __future__ import annotations

import json

import pytest

from executors.autoshard_run import (
    LOSS_RTOL,
    AutoshardInput,
    AutoshardRankResult,
    AutoshardRunConfig,
    ReferenceResult,
    check_plan,
    fold,
    load_factory,
    mesh_coords,
    run_plan,
    torch_mesh_shape,
)
from planner.autoshard.result import AutoshardResult
from planner.errors import SpecError

GPT = "tests.autoshard.models:small_gpt"
CNN = "tests.autoshard.models:small_cnn"
GPT_INPUTS = [{"shape": [4, 32], "dtype": "int64", "high": 128}, {"shape": [4, 32], "dtype": "int64", "high": 128}]
CNN_INPUTS = [{"shape": [4, 3, 32, 32], "dtype": "float32"}, {"shape": [4], "dtype": "int64", "high": 10}]
STEPS = 4
TIMEOUT_S = 180.0
R = "Replicate()"


def make_plan(params: dict[str, list[str]], inputs: list[list[str]], mesh: list[int],
              activations: dict[str, list[str]] | None = None) -> AutoshardResult:
    n = 1
    for size in mesh:
        n *= size
    return AutoshardResult(
        cluster="local-cpu", gpu="local-cpu", num_gpus=n, mesh_shape=mesh,
        mesh_axes=[f"axis{i}" for i in range(len(mesh))],
        pp=1, micro_batches=1, memory_budget_bytes=1e9, params=params, inputs=inputs, activations=activations or {},
        nodes=[], stages=[], step_time_s=0.02, time_s={}, memory_bytes={}, peak_memory_bytes=0.0, unknown_ops=[],
        solver="heuristic", solver_note="written by hand for the test", optimal=False, num_graph_nodes=0,
        trace_time_s=0.0, solve_time_s=0.0)


def gpt_params(tensor_parallel: bool, layers: int = 2) -> dict[str, list[str]]:
    """small_gpt's parameters: Megatron-style (q, k, v, fc1 column-parallel: weight and bias Shard(0); proj, fc2
    row-parallel: weight Shard(1), bias replicated; the vocabulary head Shard(0), i.e. vocab-parallel logits;
    embeddings and norms replicated), or all replicated."""
    names = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "head.weight"]
    for i in range(layers):
        for mod in ("ln1", "ln2", "attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc1", "mlp.fc2"):
            names += [f"blocks.{i}.{mod}.weight", f"blocks.{i}.{mod}.bias"]
    out = {}
    for name in names:
        leaf, kind = name.split(".")[-2], name.split(".")[-1]
        if tensor_parallel and (leaf in ("q", "k", "v", "fc1") or name == "head.weight"):
            out[name] = ["Shard(0)"]
        elif tensor_parallel and leaf in ("proj", "fc2") and kind == "weight":
            out[name] = ["Shard(1)"]
        else:
            out[name] = [R]
    return out


CNN_PARAMS = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight", "fc.bias"]


def assert_parity(result) -> None:
    detail = f"{result.outcome}: {result.reason}\n{result.stderr_tail}"
    assert result.outcome == "ok", detail
    assert result.parity_passed and result.max_rel_error is not None and result.max_rel_error <= LOSS_RTOL
    assert len(result.losses) == len(result.reference_losses) == STEPS
    assert result.losses[-1] < result.losses[0]  # it trained: the update check compares real loss changes
    assert result.step_time_s is not None and result.step_time_s > 0
    assert result.predicted_step_time_s == 0.02


# --- no processes -----------------------------------------------------------------------------------------------

def test_mesh_convention_is_innermost_first():
    assert [mesh_coords(r, [2, 2]) for r in range(4)] == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert [mesh_coords(r, [2, 3]) for r in range(6)][3] == [1, 1]
    assert torch_mesh_shape([2, 4]) == (4, 2)


@pytest.mark.parametrize("factory", ["os.system", "tests.autoshard.models:small_gpt()", "a:b:c", "1mod:f", "",
                                     "tests.autoshard.models:small gpt"])
def test_bad_factory_string_is_one_line(factory):
    with pytest.raises(SpecError) as err:
        run_plan(factory, GPT_INPUTS, make_plan(gpt_params(False), [[R], [R]], [2]))
    text = str(err.value)
    assert "\n" not in text and text.startswith("factory: ") and "must be package.module:function" in text


def test_factory_that_does_not_import_or_is_no_callable():
    with pytest.raises(SpecError, match="cannot import 'tests.autoshard.nope'"):
        load_factory("tests.autoshard.nope:small_gpt")
    with pytest.raises(SpecError, match="has no callable 'tiny_gpt'"):
        load_factory("tests.autoshard.models:tiny_gpt")
    with pytest.raises(SpecError, match="has no callable 'LOSS_RTOL'"):
        load_factory("executors.autoshard_run:LOSS_RTOL")


def test_plans_that_cannot_run_as_written_are_refused():
    inputs = [AutoshardInput.model_validate(i) for i in GPT_INPUTS]
    params = gpt_params(False)
    with pytest.raises(SpecError, match=r"plan.params\['wte.weight'\]: 'Partial\(\)'"):
        check_plan(make_plan(params | {"wte.weight": ["Partial()"]}, [[R], [R]], [2]), inputs)
    with pytest.raises(SpecError, match=r"plan.inputs\[0\]: Shard\(2\) names a dimension"):
        check_plan(make_plan(params, [["Shard(2)"], [R]], [2]), inputs)
    with pytest.raises(SpecError, match=r"placement must be 'Replicate\(\)'"):
        check_plan(make_plan(params | {"wte.weight": ["Sharded(0)"]}, [[R], [R]], [2]), inputs)
    with pytest.raises(SpecError, match="2 placements for a 1-axis mesh"):
        check_plan(make_plan(params, [[R, R], [R]], [2]), inputs)
    with pytest.raises(SpecError, match="holds 1 placements but 2 inputs"):
        check_plan(make_plan(params, [[R]], [2]), inputs)
    with pytest.raises(SpecError, match=r"inputs\[0\]"):
        run_plan(GPT, [{"shape": [4, 32], "dtype": "int64"}], make_plan(params, [[R]], [2]))


def _folded(losses_per_rank, reference):
    cfg = AutoshardRunConfig(factory=GPT, inputs=[AutoshardInput.model_validate(i) for i in GPT_INPUTS],
                             plan=make_plan(gpt_params(False), [[R], [R]], [2]), steps=3)
    ranks = [AutoshardRankResult(rank=i, status="ok", coords=[i], losses=losses, step_times_s=[0.3, 0.1, 0.2])
             for i, losses in enumerate(losses_per_rank)]
    ref = ReferenceResult(losses=reference, step_times_s=[0.2, 0.05, 0.05], param_numel=10)
    return fold(cfg, ranks, ref, 0, False, "", 1.0)


def test_fold_passes_matching_losses_and_times_the_steps_after_the_first():
    out = _folded([[5.0, 4.9, 4.8]] * 2, [5.0, 4.9, 4.8])
    assert out.outcome == "ok" and out.parity_passed and out.step_time_s == pytest.approx(0.15)


def test_fold_catches_a_wrong_update_and_disagreeing_ranks():
    # the loss itself within LOSS_RTOL (6e-5) at every step, but its change since step 1 is 3% off: a gradient error
    wrong = _folded([[5.0, 4.9903, 4.9803]] * 2, [5.0, 4.99, 4.98])
    assert wrong.max_rel_error < LOSS_RTOL
    assert wrong.outcome == "wrong" and not wrong.parity_passed and "loss-change error" in wrong.reason
    split = _folded([[5.0, 4.9, 4.8], [5.0, 4.9, 4.7]], [5.0, 4.9, 4.8])
    assert split.outcome == "wrong" and "ranks disagree" in split.reason


# --- gloo runs ----------------------------------------------------------------------------------------------------

@pytest.mark.executor
@pytest.mark.slow
def test_gpt_tensor_parallel_matches_one_process(tmp_path):
    pytest.importorskip("torch")
    activations = {f"blocks.{i}.{m}": [R] for i in range(2) for m in ("attn", "mlp")}
    plan = make_plan(gpt_params(True), [[R], [R]], [2], activations)
    result = run_plan(GPT, GPT_INPUTS, plan, steps=STEPS, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert_parity(result)
    # the column- and row-parallel weights and the head are split in two
    assert result.local_param_numel[0] == result.local_param_numel[1] < result.reference_param_numel
    assert result.coords == [[0], [1]]


@pytest.mark.executor
@pytest.mark.slow
def test_gpt_data_parallel_matches_one_process(tmp_path):
    pytest.importorskip("torch")
    plan = make_plan(gpt_params(False), [["Shard(0)"], ["Shard(0)"]], [2], {"blocks.0": ["Shard(0)"]})
    result = run_plan(GPT, GPT_INPUTS, plan, steps=STEPS, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert_parity(result)
    assert result.local_param_numel == [result.reference_param_numel] * 2


@pytest.mark.executor
@pytest.mark.slow
def test_cnn_data_parallel_matches_one_process(tmp_path):
    pytest.importorskip("torch")
    plan = make_plan({p: [R] for p in CNN_PARAMS}, [["Shard(0)"], ["Shard(0)"]], [2], {"conv2": ["Shard(0)"]})
    assert_parity(run_plan(CNN, CNN_INPUTS, plan, steps=STEPS, out_dir=tmp_path, timeout_s=TIMEOUT_S))


@pytest.mark.executor
@pytest.mark.slow
def test_cnn_with_sharded_output_channels_is_refused_not_rewritten(tmp_path):
    """DTensor's CPU convolution computes a sharded weight's local slice as if it were the whole weight (a wrong
    loss marked replicated): the run must stop and name the op and the placement."""
    pytest.importorskip("torch")
    params = {p: [R] for p in CNN_PARAMS} | {"conv1.weight": ["Shard(0)"], "conv1.bias": ["Shard(0)"],
                                             "conv2.weight": ["Shard(1)"]}
    result = run_plan(CNN, CNN_INPUTS, make_plan(params, [[R], [R]], [2]), steps=STEPS, out_dir=tmp_path,
                      timeout_s=TIMEOUT_S)
    assert result.outcome == "unsupported", result.reason
    assert "aten.convolution" in result.reason and "conv1.weight ['Shard(0)']" in result.reason
    assert not result.parity_passed and result.losses == []


@pytest.mark.executor
@pytest.mark.slow
def test_cnn_with_channel_sharded_activation_into_a_convolution_is_refused(tmp_path):
    pytest.importorskip("torch")
    plan = make_plan({p: [R] for p in CNN_PARAMS}, [["Shard(0)"], ["Shard(0)"]], [2], {"conv1": ["Shard(1)"]})
    result = run_plan(CNN, CNN_INPUTS, plan, steps=STEPS, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert result.outcome == "unsupported", result.reason
    assert "module 'conv2'" in result.reason and "[Shard(1)]" in result.reason


@pytest.mark.executor
@pytest.mark.slow
def test_gpt_on_a_2x2_mesh_tensor_parallel_inside_data_parallel(tmp_path):
    """Axis 0 (innermost: ranks 0-1 and 2-3) is tensor parallel, axis 1 data parallel."""
    pytest.importorskip("torch")
    params = {name: [pl[0], R] for name, pl in gpt_params(True).items()}
    plan = make_plan(params, [[R, "Shard(0)"], [R, "Shard(0)"]], [2, 2])
    result = run_plan(GPT, GPT_INPUTS, plan, steps=STEPS, out_dir=tmp_path, timeout_s=TIMEOUT_S)
    assert_parity(result)
    assert result.coords == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert len(set(result.local_param_numel)) == 1 and result.local_param_numel[0] < result.reference_param_numel


# --- the command line ---------------------------------------------------------------------------------------------

def test_cli_bad_input_exits_2_with_one_line(capsys):
    from planner.cli import main

    for argv, expect in (
        (["--autoshard", "tests.autoshard.models:small_gpt()", "--input-shape", "4,32:int64:128"],
         "--autoshard: 'tests.autoshard.models:small_gpt()' must be package.module:function"),
        (["--autoshard", GPT, "--input-shape", "4,x"], "input_shape: '4,x' must be positive integers"),
        (["--autoshard", GPT, "--input-shape", "4,32:int64:128", "--factory-arg", "layers"],
         "factory_arg: 'layers' must be NAME=VALUE"),
        (["--autoshard", GPT, "--input-shape", "4,32:int64:128", "--model", "llama3-8b"], "drop --model"),
        (["--input-shape", "4,32:int64:128", "--model", "llama3-8b"], "go with --autoshard"),
    ):
        assert main(["validate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expect in err, err


def test_factory_args_are_parsed_without_eval():
    from planner.cli.validate_autoshard import parse_factory_arg, parse_input_shape

    assert parse_factory_arg("layers=2") == ("layers", 2)
    assert parse_factory_arg("scale=1e-3") == ("scale", 1e-3)
    assert parse_factory_arg("flag=true") == ("flag", True)
    assert parse_factory_arg("name=__import__('os')") == ("name", "__import__('os')")
    assert parse_input_shape("4,3,32,32") == {"shape": [4, 3, 32, 32], "dtype": "float32", "high": None}
    assert parse_input_shape("4,32:int64:128") == {"shape": [4, 32], "dtype": "int64", "high": 128}


@pytest.mark.executor
@pytest.mark.slow
def test_cli_runs_the_plan_the_solver_returns(capsys, tmp_path, monkeypatch):
    """The command's path with the solver stood in for by a hand-written plan: it gets a zero-argument factory and
    the inputs, and the run's JSON carries both step times and the parity."""
    pytest.importorskip("torch")
    import planner.cli.validate_autoshard as cmd
    from planner.cli import main

    seen = {}

    def solve(module, example_inputs, cluster, num_gpus, **kwargs):
        seen.update(module=module(), inputs=example_inputs, cluster=cluster, num_gpus=num_gpus)
        return make_plan(gpt_params(False, layers=1), [["Shard(0)"], ["Shard(0)"]], [num_gpus])

    monkeypatch.setattr(cmd, "autoshard", solve)
    monkeypatch.setattr(cmd, "_example_inputs", tuple)  # the InputSpecs of planner.autoshard.trace, as dicts
    code = main(["validate", "--autoshard", GPT, "--input-shape", "4,32:int64:128", "--input-shape",
                 "4,32:int64:128", "--factory-arg", "layers=1", "--ranks", "2", "--steps", "3", "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    data = json.loads(out.out)
    assert data["outcome"] == "ok" and data["parity_passed"] and len(data["losses"]) == 3
    assert data["predicted_step_time_s"] == 0.02 and data["step_time_s"] > 0
    assert len(seen["module"].blocks) == 1 and seen["cluster"] == "local-cpu" and seen["num_gpus"] == 2
    assert [i["shape"] for i in seen["inputs"]] == [[4, 32], [4, 32]]


@pytest.mark.executor
@pytest.mark.slow
def test_cli_solves_and_runs_small_gpt(capsys, tmp_path):
    pytest.importorskip("torch")
    from planner.cli import main

    code = main(["validate", "--autoshard", GPT, "--input-shape", "32,32:int64:128", "--input-shape",
                 "32,32:int64:128", "--factory-arg", "layers=1", "--factory-arg", "hidden=256", "--ranks", "2",
                 "--steps", "3", "--work-dir", str(tmp_path / "run"), "--format", "json"])
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert code == 0, out.err
    assert data["outcome"] == "ok" and data["parity_passed"]
    assert data["predicted_step_time_s"] > 0 and data["step_time_s"] > 0
    assert data["plan"]["num_gpus"] == 2 and data["factory_kwargs"] == {"layers": 1, "hidden": 256}
    # at this size the solver splits the linears (tensor parallel): the run exercises sharded weights
    assert data["plan"]["params"]["blocks.0.attn.q.weight"] == ["Shard(0)"]
    assert data["plan"]["params"]["blocks.0.mlp.fc2.weight"] == ["Shard(1)"]


@pytest.mark.executor
@pytest.mark.slow
def test_cli_solves_and_runs_small_cnn(capsys, tmp_path):
    """The solver's own plan for the small CNN on 2 ranks (at 256 images the batch is split: data parallel)
    runs with loss parity."""
    pytest.importorskip("torch")
    from planner.cli import main

    code = main(["validate", "--autoshard", "tests.autoshard.models:small_cnn", "--input-shape", "256,3,32,32",
                 "--input-shape", "256:int64:10", "--ranks", "2", "--steps", "3", "--work-dir", str(tmp_path / "run"),
                 "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    data = json.loads(out.out)
    assert data["outcome"] == "ok" and data["parity_passed"]
    assert data["predicted_step_time_s"] > 0 and data["step_time_s"] > 0
    assert data["plan"]["inputs"][0] == ["Shard(0)"]
