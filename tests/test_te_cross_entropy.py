"""Megatron's --cross-entropy-fusion-impl te: Transformer Engine's Triton parallel cross-entropy, which
reads the 16-bit logits and writes their gradient over them in place (TrainSpec.cross_entropy_fusion_impl)."""

from __future__ import annotations

import pytest

from cost_models.blocks import model_blocks
from cost_models.compute import head_times
from cost_models.step import micro_of
from cost_models.arrays import StrategyArrays
from planner import Strategy, TrainSpec
from tests.framework_defaults import evaluate
from planner.cli import main
from planner.errors import SpecError
from profiles import load_cluster, load_model

GIB = 2**30
KW = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=8192, precision="bf16",
          strategy=Strategy(tp=1, zero_stage=1, micro_batch_size=2))


def test_te_loss_holds_the_logits_only():
    """Native keeps 12 bytes per logit at its peak, Transformer Engine's the 16-bit logits alone: 2 bytes."""
    native, te = evaluate(**KW), evaluate(**KW, cross_entropy_fusion_impl="te")
    logits = 2 * 8192 * 128256  # micro-batch 2 x 8192 tokens x Llama 3's vocabulary (a multiple of 128)
    assert native.memory_bytes["logits"] - te.memory_bytes["logits"] == pytest.approx(10 * logits, rel=1e-6)
    assert te.peak_memory_bytes < native.peak_memory_bytes


def test_te_loss_moves_fewer_bytes():
    """Forward 6 bytes per logit in 2 kernels against native's 22 in 3; backward 4 in 1 against 14 in 2."""
    gpu = load_cluster("dgx-h100").gpu
    head = model_blocks(load_model("llama3-8b")).head
    st = StrategyArrays.from_strategies([Strategy(tp=1, dp=1)])
    times = {impl: head_times(head, micro_of(TrainSpec(global_batch_size=8, seq_len=8192,
                                                       cross_entropy_fusion_impl=impl), st), gpu)
             for impl in ("native", "te")}
    assert times["te"][0][0] < times["native"][0][0] and times["te"][1][0] < times["native"][1][0]
    assert times["te"][2][0] == times["native"][2][0]  # the output layer's FLOPs are the same


@pytest.mark.parametrize("train,rule", [(dict(framework="torchtitan"), "framework 'torchtitan'"),
                                        (dict(cross_entropy_fusion=False), "needs cross_entropy_fusion")])
def test_te_loss_outside_megatrons_fused_path_is_refused(train, rule):
    with pytest.raises(SpecError, match=rule):
        TrainSpec(global_batch_size=8, seq_len=4096, cross_entropy_fusion_impl="te", **train)


def test_cli_takes_the_implementation_and_refuses_a_contradiction(capsys):
    base = ["evaluate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "16",
            "--seq-len", "4096", "--tp", "1", "--mbs", "1", "--zero", "1", "--recompute", "full", "--format", "json"]

    def run(*extra):
        code = main(base + list(extra))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = run("--cross-entropy-fusion-impl", "te")
    assert code == 0, err
    code, out, err = run("--cross-entropy-fusion-impl", "te", "--framework", "torchtitan")
    assert code != 0 and "cross_entropy_fusion_impl 'te'" in err and "Traceback" not in err
    code, out, err = run("--cross-entropy-fusion-impl", "xla")
    assert code != 0 and "cross_entropy_fusion_impl" in err and "Traceback" not in err


def test_validate_refuses_a_plan_costed_with_te_loss(capsys, tmp_path):
    """The CPU runs compute PyTorch's cross-entropy: a plan costed with Transformer Engine's is refused before any
    run starts, naming the field."""
    code = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch-size", "16",
                 "--seq-len", "4096", "--top", "1", "--cross-entropy-fusion-impl", "te", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan_file = tmp_path / "plans.json"
    plan_file.write_text(out)
    code = main(["validate", "--plan", str(plan_file), "--steps", "1"])
    out, err = capsys.readouterr()
    assert code != 0 and "cross_entropy_fusion_impl 'te'" in err and "Traceback" not in err
