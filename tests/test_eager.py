"""torch_compile false: torchtitan's eager PyTorch operators (cost_models.blocks eager_* and gated_activation)."""

from __future__ import annotations

import pytest

from planner.api import evaluate, plan
from planner.errors import SpecError

LLAMA = dict(model="llama3.1-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=8192,
             strategy={"dp": 8, "zero_stage": 3, "micro_batch_size": 2, "recompute": "full"}, framework="torchtitan")


def test_eager_llama_is_slower_by_its_element_wise_traffic_and_keeps_its_memory():
    """RMSNorm decomposed in fp32 (36 bytes per element against 4), rotary in complex fp32, SiLU and the gate
    product apart, the attention output copied back: a step of Llama-3.1-8B takes 10-20 % longer eager, as
    torchtitan's published runs show (H100, 128 GPUs: 2.92 s eager, 2.52 s compiled); memory is costed alike."""
    compiled, eager = evaluate(**LLAMA), evaluate(**LLAMA, torch_compile=False)
    assert 1.10 < eager.step_time_s / compiled.step_time_s < 1.20
    assert eager.peak_memory_bytes == compiled.peak_memory_bytes
    assert eager.time_s["dp_comm"] == compiled.time_s["dp_comm"]


def test_a_layernorm_gelu_model_without_rotary_barely_changes_eager():
    """MPT: LayerNorm is one ATen kernel eager too, GELU one kernel, no rotary; only the attention output copy
    remains."""
    run = dict(LLAMA, model="mpt-7b", seq_len=2048, strategy={"dp": 8, "zero_stage": 3, "micro_batch_size": 2})
    compiled, eager = evaluate(**run), evaluate(**run, torch_compile=False)
    assert 1.0 < eager.step_time_s / compiled.step_time_s < 1.01


@pytest.mark.parametrize("changes,message", [
    ({"framework": "megatron"}, r"torch_compile false with framework 'megatron'.*torchtitan only"),
    ({"framework": "deepspeed"}, r"torch_compile false with framework 'deepspeed'"),
    ({"model": "deepseek-v2-lite"}, r"torch_compile false with latent attention"),
])
def test_eager_is_refused_where_it_is_not_costed(changes, message):
    run = dict(LLAMA, num_gpus=16, global_batch_size=64, seq_len=4096) | changes
    run.pop("strategy")
    with pytest.raises(SpecError, match=message):
        plan(**run, torch_compile=False)


def test_the_cli_takes_no_torch_compile_and_refuses_it_for_megatron(capsys):
    from planner.cli import main

    base = ["evaluate", "-m", "llama3.1-8b", "-c", "dgx-h100", "-n", "8", "-b", "16", "-s", "8192", "--dp", "8",
            "--zero", "3", "--mbs", "2", "--recompute", "full"]
    assert main(base + ["--framework", "torchtitan", "--no-torch-compile"]) == 0
    capsys.readouterr()
    assert main(base + ["--no-torch-compile"]) == 2
    out, err = capsys.readouterr()
    assert "torch_compile false with framework 'megatron'" in err and "Traceback" not in out + err


def test_the_torchtitan_job_compiles_exactly_when_the_plan_was_costed_compiled():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "emit"))
    from emit_plans import make_plan
    from planner.emit import emit_data

    args = ("llama3-8b", "dgx-h100", 16, 64, 4096)
    on = emit_data(make_plan(*args, strategy=dict(zero_stage=3), framework="torchtitan"), "torchtitan")
    off = emit_data(make_plan(*args, strategy=dict(zero_stage=3), framework="torchtitan", torch_compile=False),
                    "torchtitan")
    assert on["config"]["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert off["config"]["compile"] == {"enable": False}
