"""Every input checked: batch, GPU count against node size, sequence against context, a model
of a preset's shape that disagrees with the preset (warnings); one error type, SpecError, for
every bad value (one line, exit 2 in the CLI); evaluate() keeps the README's promise."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import yaml

from planner import ModelSpec, Strategy, evaluate, plan
from planner.api import make_inputs
from planner.cli import main
from planner.errors import InputWarning, SpecError
from planner.specs import TrainSpec

BASE = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096)
#: Llama 3 8B's shape with ModelSpec's defaults (plain MLP, tied embeddings, MHA).
LLAMA_SHAPED = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336, vocab_size=128256)


def input_warnings(**kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_inputs(**(BASE | kw))
    return [str(w.message) for w in caught if issubclass(w.category, InputWarning)]


def test_batch_no_data_parallel_degree_divides_warns():
    found = input_warnings(global_batch_size=7)
    assert any("global_batch_size (7)" in m and "only dp=1" in m and "must divide global_batch_size" in m
               for m in found), found
    assert not [m for m in input_warnings(global_batch_size=64) if "global_batch_size" in m]


def test_batch_with_only_dp1_still_plans_dp1():
    with pytest.warns(InputWarning, match="only dp=1"):
        result = plan(**(BASE | {"global_batch_size": 7}), top_k=3)
    assert result.plans and all(p.strategy.dp == 1 for p in result.plans)


def test_gpus_not_filling_nodes_warns_naming_the_rule():
    found = input_warnings(num_gpus=12, global_batch_size=48)
    assert any("num_gpus (12) is not a multiple of gpus_per_node (8)" in m for m in found), found
    assert not [m for m in input_warnings(num_gpus=16) if "gpus_per_node" in m]
    assert not [m for m in input_warnings(num_gpus=4) if "gpus_per_node" in m]  # part of one node is fine


def test_sequence_beyond_context_warns():
    found = input_warnings(seq_len=32768)  # llama3-8b: max_position_embeddings 8192
    assert any("seq_len (32768) exceeds model llama3-8b's context (max_position_embeddings 8192)" in m
               for m in found), found
    assert not [m for m in input_warnings(seq_len=8192) if "context" in m]


def test_context_read_from_hf_config(tmp_path):
    import json

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    found = input_warnings(model=str(path), seq_len=32768)
    assert any("max_position_embeddings 4096" in m for m in found), found


def test_hand_built_model_unset_context_does_not_warn():
    m = ModelSpec(name="mine", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  vocab_size=100)  # rope, context not given: nothing to compare with
    assert not [w for w in input_warnings(model=m, seq_len=32768) if "context" in w]


def test_preset_shaped_model_with_default_fields_warns_naming_them():
    found = input_warnings(model=ModelSpec(**LLAMA_SHAPED))
    hit = [m for m in found if "has the shape of preset" in m]
    assert hit and "gated_mlp (False; the preset: True)" in hit[0] and "tie_embeddings (True; the preset: False)" in hit[0]
    assert "kv_heads (32; the preset: 8)" in hit[0] and "%" in hit[0]
    same = ModelSpec(**LLAMA_SHAPED, num_kv_heads=8, gated_mlp=True, tie_embeddings=False)
    assert not [m for m in input_warnings(model=same) if "has the shape of preset" in m]
    assert not [m for m in input_warnings() if "has the shape of preset" in m]  # the preset itself


def test_strategy_bad_value_is_spec_error():
    with pytest.raises(SpecError, match=r"tp: Input should be greater than or equal to 1 \(got 0\)"):
        Strategy(tp=0)
    for bad in ("2", True, 2.0, 2.5, None):
        with pytest.raises(SpecError, match="tp"):
            Strategy(tp=bad)


def test_train_values_strict_like_num_gpus():
    """seq_len "2048" or True is refused as num_gpus "8" is; a fractional size is never truncated."""
    for field, bad in (("seq_len", "2048"), ("seq_len", True), ("seq_len", 2048.0), ("global_batch_size", 64.5),
                       ("num_gpus", "8"), ("num_gpus", True), ("num_gpus", 8.0)):
        with pytest.raises(SpecError, match=field if field == "num_gpus" else f"{field}: Input should be"):
            make_inputs(**(BASE | {field: bad}))
    with pytest.raises(SpecError):
        TrainSpec(global_batch_size=64, seq_len=4096.7)
    with pytest.raises(SpecError, match="num_layers"):
        ModelSpec(**(LLAMA_SHAPED | {"num_layers": 31.5}))


def test_evaluate_strategy_not_dividing_gpus_returns_estimate():
    est = evaluate(**BASE, strategy=Strategy(tp=3))
    assert not est.fits and not est.valid
    assert est.reasons[0] == "tp·cp·pp (3) must divide the number of GPUs (8)"
    assert any("tp (3) must divide num_attention_heads (32)" in r for r in est.reasons)
    est = evaluate(**BASE, strategy=Strategy(dp=2, tp=2))
    assert not est.fits and "must equal the number of GPUs (8)" in est.reasons[0]
    assert evaluate(**BASE, strategy=Strategy(tp=2)).valid


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


CLI = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "64", "--seq-len", "4096"]


@pytest.mark.parametrize("args", [
    ["plan", *CLI, "--precision", "int4"],
    ["plan", *CLI, "--top", "0"],
    ["plan", *CLI, "--top", str(10**9)],
    ["plan", *CLI[:-2], "--seq-len", "4096.5"],
    ["plan", *CLI, "--bogus"],
    ["evaluate", *CLI, "--tp", "0"],
    ["evaluate", *CLI, "--tp", "3"],
    ["plan", *CLI, "-C", "tp=banana"],
])
def test_cli_bad_values_one_line_exit_2(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "╭" not in err, err


def test_cli_prints_input_warnings_once(capsys):
    code, out, err = run(capsys, "plan", *CLI[:-4], "--global-batch-size", "7", "--seq-len", "32768", "--top", "1")
    assert err.count("warning: global_batch_size (7)") == 1
    assert err.count("warning: seq_len (32768) exceeds") == 1


# ---- issue #29, part 5: the last bad inputs an outside fuzz run found -------------------------------
FZ_CLUSTER = {"name": "fz", "gpu": {"name": "g", "memory_gib": 80, "peak_tflops": {"bf16": 989},
                                   "hbm_bw_gb_per_s": 3350, "host_link_gb_per_s": 50},
              "gpus_per_node": 8, "intra_node": {"name": "nvl", "bw_gb_per_s": 450, "latency_us": 3},
              "inter_node": {"name": "ib", "bw_gb_per_s": 50, "latency_us": 6},
              "host": {"memory_gib": 1024, "memory_bw_gb_per_s": 400}}


def with_value(path: tuple, value) -> dict:
    out = copy.deepcopy(FZ_CLUSTER)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def cli_error(capsys, *args: str) -> str:
    """Run the CLI on bad input: exit 2 and one `error:` line on stderr, no traceback; the line."""
    code, out, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.mark.parametrize("cons,match", [
    ({"num_layers_in_last_stage": 2**31}, "num_layers_in_last_stage=2147483648 must be an integer between 1 and 10000"),
    ({"num_layers_in_first_stage": 2**31}, "num_layers_in_first_stage=2147483648 must be an integer between 1 and"),
    ({"num_layers_in_last_stage": 33}, r"num_layers_in_last_stage=33 must be at most the model's num_layers \(32\)"),
    ({"pp": 2, "num_layers_in_first_stage": [8, 40]}, r"num_layers_in_first_stage=40 must be at most .* \(32\)"),
    ({"recompute": "full", "recompute_num_layers": 33}, r"recompute_num_layers=33 must be at most .* \(32\)"),
    ({"offload_activation_layers": 10_000}, r"offload_activation_layers=10000 must be at most .* \(32\)"),
    ({"stage_layers": [40, 0]}, r"stage_layers=\[40, 0\] must hold at most the model's num_layers \(32\)"),
])
def test_layer_count_constraints_fit_the_model_issue_29(cons, match):
    """num_layers_in_last_stage=2**31 searched for minutes: a layer count is bounded as Strategy bounds it
    (MAX_LAYERS) and by the model's own num_layers, before any search."""
    with pytest.raises(SpecError, match=match):
        plan(**BASE, constraints=cons)


def test_layer_count_constraints_within_the_model_still_plan_issue_29():
    result = plan(**BASE, constraints={"pp": 2, "num_layers_in_last_stage": 14}, top_k=1)
    assert result.plans and result.plans[0].strategy.num_layers_in_last_stage == 14


@pytest.mark.parametrize("bad", [[1], [("tp", 2)], "tp", 3, 2.5, True, [], ""])
def test_constraints_not_a_mapping_issue_29(bad):
    """A list, a string or an int raised TypeError (and an empty one was taken for no constraint)."""
    with pytest.raises(SpecError, match=r"constraints must be a mapping of Strategy field -> value or list of "
                                        r"values, e.g. .* \(got " + type(bad).__name__):
        plan(**BASE, constraints=bad)


@pytest.mark.parametrize("path,value,match", [
    (("gpu", "kernel_overhead_us"), 1e78, r"gpu: kernel_overhead_us must be between 0 and 1e\+06 \(got 1e\+78\)"),
    (("gpu", "memory_gib"), 1e78, r"gpu: memory_gib must be between 0.000976562 and 1.04858e\+06 \(got 1e\+78\)"),
    (("gpu", "memory_gib"), 1e-300, "gpu: memory_gib must be between"),
    (("gpu", "peak_tflops", "bf16"), 1e78, r"gpu: peak_tflops.bf16 must be between 1e-06 and 1e\+06"),
    (("gpu", "peak_tflops", "bf16"), 1e-300, "gpu: peak_tflops.bf16 must be between"),
    (("gpu", "hbm_bw_gb_per_s"), 1e78, r"gpu: hbm_bw_gb_per_s must be between 0.001 and 1e\+06"),
    (("gpu", "hbm_bw_gb_per_s"), 1e-300, "gpu: hbm_bw_gb_per_s must be between"),
    (("gpu", "host_link_gb_per_s"), 1e78, "gpu: host_link_gb_per_s must be between"),
    (("gpu", "host_time_scale"), 1e78, "gpu: host_time_scale must be between 1 and 100"),
    (("gpu", "framework_reserve_gib"), 1e78, "gpu: framework_reserve_gib must be between 0 and"),
    (("intra_node", "latency_us"), 1e78, r"intra_node: latency_us must be between 0 and 1e\+06"),
    (("inter_node", "bw_gb_per_s"), 1e78, "inter_node: bw_gb_per_s must be between"),
    (("inter_node", "bw_gb_per_s"), 1e-300, "inter_node: bw_gb_per_s must be between"),
    (("host", "memory_gib"), 1e78, "host: memory_gib must be between"),
    (("host", "memory_bw_gb_per_s"), 1e78, "host: memory_bw_gb_per_s must be between"),
])
def test_hardware_numbers_have_physical_ranges_issue_29(path, value, match):
    """kernel_overhead_us: 1e78 overflowed: each per-GPU, per-tier and per-host number has a finite range,
    stated in the file's unit."""
    with pytest.raises(SpecError, match=match):
        plan(**(BASE | {"cluster": with_value(path, value)}))


def test_hardware_ranges_hold_on_specs_built_in_python_issue_29():
    from planner.specs import GpuSpec, LinkTier

    gpu = dict(name="g", memory_bytes=80 * 2**30, peak_flop_per_s={"bf16": 989e12}, hbm_bw_bytes_per_s=3.35e12)
    GpuSpec(**gpu)
    for field, value in (("kernel_overhead_s", 1e72), ("memory_bytes", 1e90), ("hbm_bw_bytes_per_s", 1e-300),
                         ("host_link_bw_bytes_per_s", 1e90), ("host_time_scale", 1e9)):
        with pytest.raises(SpecError, match=field):
            GpuSpec(**(gpu | {field: value}))
    with pytest.raises(SpecError, match="peak_flop_per_s must give a rate between"):
        GpuSpec(**(gpu | {"peak_flop_per_s": {"bf16": 1e78}}))
    with pytest.raises(SpecError, match="latency_s"):
        LinkTier(name="ib", bw_bytes_per_s=5e10, latency_s=1e72)


def test_hardware_at_the_edges_of_its_ranges_gives_finite_estimates_issue_29():
    """The ranges are what keeps every term finite: the slowest and the fastest hardware they allow."""
    slow = {"name": "slow", "gpu": {"name": "g", "memory_gib": 2**20, "peak_tflops": {"bf16": 1e-6},
                                    "hbm_bw_gb_per_s": 1e-3, "kernel_overhead_us": 1e6, "host_link_gb_per_s": 1e-3,
                                    "host_time_scale": 100},
            "gpus_per_node": 8, "intra_node": {"name": "a", "bw_gb_per_s": 1e-3, "latency_us": 1e6},
            "inter_node": {"name": "b", "bw_gb_per_s": 1e-3, "latency_us": 1e6},
            "host": {"memory_gib": 2**20, "memory_bw_gb_per_s": 1e-3}}
    fast = copy.deepcopy(FZ_CLUSTER) | {"name": "fast"}
    fast["gpu"] |= {"memory_gib": 2**-10, "peak_tflops": {"bf16": 1e6}, "hbm_bw_gb_per_s": 1e6,
                    "kernel_overhead_us": 0, "host_link_gb_per_s": 1e6}
    for tier in ("intra_node", "inter_node"):
        fast[tier] |= {"bw_gb_per_s": 1e6, "latency_us": 0}
    for cluster in (slow, fast):
        est = evaluate(**(BASE | {"num_gpus": 64, "global_batch_size": 2**20, "seq_len": 8192, "cluster": cluster}),
                       strategy=Strategy(tp=8, pp=8, zero_stage=1, offload_optimizer=True))
        numbers = [est.step_time_s, est.tokens_per_s, est.mfu, est.peak_memory_bytes, *est.time_s.values(),
                   *est.memory_bytes.values()]
        assert all(math.isfinite(x) and x >= 0 for x in numbers), (cluster["name"], est)
        assert est.step_time_s > 0


@pytest.mark.parametrize("ref", ["x" * 300, "x" * 300 + ".yaml", "x" * 300 + ".json", "dir/" + "y" * 256,
                                 "z" * 5000, "dgx\x00h100", "dgx-h100\n", "\ud800.yaml"])
def test_odd_or_long_names_refused_before_the_file_system_issue_29(ref):
    """A 300-character cluster name raised OSError (file name too long)."""
    from profiles import load_cluster, load_gpu, load_model

    match = r"a preset name or file path has no control characters, at most 4096 characters and at most 255 bytes"
    for load in (load_cluster, load_model, load_gpu):
        with pytest.raises(SpecError, match=match):
            load(ref)
    with pytest.raises(SpecError, match=match):
        plan(**(BASE | {"cluster": ref}))


def test_framework_reserve_below_the_gpu_memory_issue_29():
    """A memory reserve above the GPU's memory was accepted (every plan then 'needed' more than the GPU has)."""
    for reserve in (80, 100):
        with pytest.raises(SpecError, match=rf"framework_reserve_bytes \({reserve:g} GiB\) must be less than the "
                                            r"GPU's memory_bytes \(80 GiB\)"):
            plan(**(BASE | {"cluster": with_value(("gpu", "framework_reserve_gib"), reserve)}))
    assert plan(**(BASE | {"cluster": with_value(("gpu", "framework_reserve_gib"), 2)}), top_k=1).plans


def test_cli_last_bad_inputs_exit_2_with_one_line_issue_29(capsys, tmp_path):
    bad = tmp_path / "overhead.yaml"
    bad.write_text(yaml.safe_dump(with_value(("gpu", "kernel_overhead_us"), 1e78)))
    assert "kernel_overhead_us must be between 0 and 1e+06" in cli_error(capsys, "plan", *CLI[:2], "--cluster",
                                                                          str(bad), *CLI[4:])
    reserve = tmp_path / "reserve.yaml"
    reserve.write_text(yaml.safe_dump(with_value(("gpu", "framework_reserve_gib"), 100)))
    assert "framework_reserve_bytes (100 GiB) must be less than" in cli_error(capsys, "evaluate", *CLI[:2],
                                                                               "--cluster", str(reserve), *CLI[4:])
    assert "at most 255 bytes" in cli_error(capsys, "plan", *CLI[:2], "--cluster", "x" * 300, *CLI[4:])
    assert "at most 255 bytes" in cli_error(capsys, "plan", "--model", "m" * 300 + ".json", *CLI[2:])
    assert "num_layers_in_last_stage=2147483648 must be an integer between 1 and 10000" in cli_error(
        capsys, "plan", *CLI, "-C", "num_layers_in_last_stage=2147483648")
    assert "num_layers_in_last_stage=33 must be at most the model's num_layers (32)" in cli_error(
        capsys, "plan", *CLI, "-C", "pp=2", "-C", "num_layers_in_last_stage=33")
    for text, kind in (("[1]", "array"), ('"tp"', "string"), ("3", "number")):
        assert f"Strategy field -> value or list of values, e.g. '{{\"tp\": 4, \"pp\": [2, 4]}}' (got a JSON {kind})" \
            in cli_error(capsys, "plan", *CLI, "--constraints", text)
    assert "must be a preset name" in cli_error(capsys, "profile", "--name", "p" * 300)
