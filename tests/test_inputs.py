"""Every input checked: batch, GPU count against node size, sequence against context, a model
of a preset's shape that disagrees with the preset (warnings); one error type, SpecError, for
every bad value (one line, exit 2 in the CLI); evaluate() keeps the README's promise."""

from __future__ import annotations

import warnings

import pytest

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
