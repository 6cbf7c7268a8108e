"""Fine-tuning with adapters (LoRA, QLoRA) and full fine-tuning: parameter counts against peft, the memory terms
of a frozen base, the backward of frozen layers, the rules, the CLI and the published Lit-GPT figures."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from benchmarks.finetune_memory import DATA, predict
from cost_models import finetune
from cost_models.units import BF16
from planner import evaluate, plan
from planner.cli import main
from planner.specs import Strategy, TrainSpec
from planner.specs.adapters import adapter_params
from planner.specs.hf import read_hf_config
from profiles import load_model

warnings.simplefilter("ignore")


class Ran:
    def __init__(self, code: int, stdout: str, stderr: str):
        self.exit_code, self.stdout, self.output = code, stdout, stdout + stderr


@pytest.fixture
def cli(capsys):
    """The CLI in this process: its exit code, standard output, and both streams together."""
    def run(args: list[str]) -> Ran:
        code = main(list(args))
        out, err = capsys.readouterr()
        return Ran(code, out, err)
    return run

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 176, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
                "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.mark.parametrize("targets, layers, rank", [
    (None, None, 8),
    (["q_proj", "v_proj"], None, 4),
    (["o_proj", "down_proj", "gate_proj"], [1, 3], 16),
    (["k_proj"], [0], 1),
])
def test_adapter_count_equals_peft(targets, layers, rank):
    """peft's own count of trainable parameters on a small Llama built here (no download) equals ours."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items()
                                                                   if k not in ("architectures",)}))
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or all_linear,
                             layers_to_transform=layers, layers_pattern="layers" if layers else None)
    trainable, _ = peft.get_peft_model(hf, config).get_nb_trainable_parameters()
    spec = read_hf_config(dict(LLAMA_CONFIG), name="tiny-llama")
    train = TrainSpec(global_batch_size=1, seq_len=128, finetune="lora", lora_rank=rank, lora_target_modules=targets,
                      lora_layers=layers)
    assert adapter_params(spec, train) == trainable


#: (targets, lora_dropout, adapter_precision, kv_heads) of the layers whose saved tensors are measured
LAYER_CASES = [
    (None, 0.0, "fp32", 2),
    (["q_proj", "v_proj"], 0.0, "bf16", 2),
    (["q_proj", "v_proj"], 0.1, "bf16", 8),
    (["o_proj", "down_proj"], 0.05, "fp32", 4),
    (["down_proj"], 0.0, "fp32", 1),
    (["gate_proj", "up_proj", "k_proj"], 0.0, "bf16", 2),
    ("full", 0.0, "fp32", 2),  # no adapters: every weight trained (model_code transformers, finetune full)
]
LAYER_SHAPE = dict(h=256, f=704, s=96, b=2, heads=8)  # no weight has a dimension of b or b·s


@pytest.fixture(scope="module")
def saved_bytes() -> list[dict]:
    """Per LAYER_CASES row, the bytes autograd saves for a 2- and a 3-layer model, measured in one fresh
    interpreter: measured inside the whole suite's process, the adapter layers kept more (state an earlier test
    leaves behind; importing the toolkits, DeepSpeed or bitsandbytes first does not change it)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    g = LAYER_SHAPE
    cases = [dict(config=dict(hidden_size=g["h"], intermediate_size=g["f"], num_attention_heads=g["heads"],
                              num_key_value_heads=kv, vocab_size=512, max_position_embeddings=512,
                              attn_implementation="sdpa"),
                  targets=targets, dropout=dropout, fp32=precision == "fp32", b=g["b"], s=g["s"])
             for targets, dropout, precision, kv in LAYER_CASES]
    done = subprocess.run([sys.executable, "-c", SAVED_BYTES, json.dumps(cases)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(LAYER_CASES)), ids=lambda i: str(LAYER_CASES[i][:2]))
def test_layer_activations_equal_what_autograd_saves(case, saved_bytes):
    """`finetune.layer_activation_bytes` against the tensors PyTorch's autograd saves for one Hugging Face Llama
    decoder layer with peft adapters, in bf16 under the Trainer's autocast (parameters and their casts excluded; a
    layer's share taken as the difference of a 3-layer and a 2-layer model)."""
    targets, dropout, adapter_precision, kv_heads = LAYER_CASES[case]
    h, f, s, b, heads = (LAYER_SHAPE[k] for k in ("h", "f", "s", "b", "heads"))
    measured = saved_bytes[case]
    measured = measured["3"] - measured["2"]
    spec = read_hf_config(dict(LLAMA_CONFIG, hidden_size=h, intermediate_size=f, num_attention_heads=heads,
                               num_key_value_heads=kv_heads), name="tiny-llama")
    if targets == "full":
        train = TrainSpec(global_batch_size=b, seq_len=s, finetune="full", model_code="transformers")
    else:
        train = TrainSpec(global_batch_size=b, seq_len=s, finetune="lora", lora_rank=8, lora_target_modules=targets,
                          lora_dropout=dropout, adapter_precision=adapter_precision)
    # CPU dropout keeps a noise tensor in its input's dtype (fp32 adapters drop out their fp32 cast), not a bool mask
    predicted = finetune.layer_activation_bytes(spec, train, s * b, mask_bytes=4 if adapter_precision == "fp32" else 2)
    assert predicted == pytest.approx(measured, rel=0.02)


#: Bytes autograd saves for small Llamas of 2 and 3 layers with peft adapters (argv[1]: JSON list of cases: the
#: config, the targets, the dropout, whether adapters are fp32, the batch and sequence); prints a JSON list of
#: {"2": bytes, "3": bytes}, one per case.
SAVED_BYTES = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers, peft
results = []
for a in json.loads(sys.argv[1]):
  b, s = a["b"], a["s"]
  out = {}
  for layers in (2, 3):
      torch.manual_seed(0)
      model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **a["config"]))
      model = model.to(torch.bfloat16)
      if a["targets"] != "full":
          model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=a["targets"] or "all-linear",
                                      lora_dropout=a["dropout"]), autocast_adapter_dtype=a["fp32"])
      model.train()
      params = {p.untyped_storage().data_ptr() for p in model.parameters()}
      seen = {}
      def pack(t):  # activations only: a batch- or token-major tensor that is no parameter (nor a cast of one)
          st = t.untyped_storage()
          if st.data_ptr() not in params and t.dim() >= 2 and t.shape[0] in (b, b * s):
              seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
          return t
      ids = torch.randint(0, 512, (b, s))
      with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
          model(input_ids=ids, labels=ids)
      out[str(layers)] = sum(seen.values())
  results.append(out)
print(json.dumps(results))
"""


def _estimate(mode: str, **kw):
    strategy = kw.pop("strategy", Strategy(dp=8, zero_stage=0, micro_batch_size=1, recompute="full"))
    extra = {"lora_rank": 16} if mode in ("lora", "qlora") else {}
    kw.setdefault("framework", "torchtitan")  # zero 0 is DDP there (DeepSpeed refuses zero 0 with fp32 gradients)
    est = evaluate(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
                   finetune=mode, strategy=strategy, **extra, **kw)
    assert est.valid or kw.get("expect_invalid"), est.reasons
    return est


def test_frozen_base_has_no_gradients_or_optimizer_states():
    model = load_model("llama3-8b")
    train = TrainSpec(global_batch_size=16, seq_len=4096, finetune="lora", lora_rank=16)
    n = adapter_params(model, train)
    lora, qlora, full = _estimate("lora"), _estimate("qlora"), _estimate("full")
    for est in (lora, qlora):
        m = est.memory_bytes
        assert m["grads"] == pytest.approx(n * 4) and m["adapters"] == pytest.approx(n * 4)  # fp32 adapters
        assert m["optimizer"] == pytest.approx(n * 8)  # two fp32 Adam moments, nothing for the base
    assert full.memory_bytes["adapters"] == 0 and full.memory_bytes["grads"] > 50 * lora.memory_bytes["grads"]
    # 16-bit base against NF4 with double quantisation: the linear weights at 4.127 bits, the rest unchanged
    linear = finetune.linear_weights_per_layer(model) * model.num_layers
    saved = lora.memory_bytes["params"] - qlora.memory_bytes["params"]
    assert saved == pytest.approx(linear * (BF16 - finetune.nf4_bytes_per_weight(True)))
    assert qlora.memory_bytes["dequant_buffer"] == pytest.approx(model.hidden_size * model.ffn_hidden_size * BF16)
    assert lora.memory_bytes["dequant_buffer"] == 0


def test_zero_stages_shard_adapter_states_only():
    z = {k: _estimate("lora", strategy=Strategy(dp=8, zero_stage=k, micro_batch_size=1, recompute="full")).memory_bytes
         for k in (0, 1, 2, 3)}
    assert z[1]["optimizer"] == pytest.approx(z[0]["optimizer"] / 8) and z[1]["grads"] == z[0]["grads"]
    assert z[2]["grads"] == pytest.approx(z[0]["grads"] / 8) and z[2]["params"] == z[0]["params"]
    assert z[3]["params"] == pytest.approx(z[0]["params"] / 8)
    assert z[3]["adapters"] == pytest.approx(z[0]["adapters"] / 8)


def test_frozen_backward_is_cheaper_and_stops_at_the_lowest_adapter():
    """No weight gradients: a LoRA step computes less than full training of the same layout; adapters on the top
    half of the layers run the backward on those layers only, and store their activations only."""
    same = dict(framework="torchtitan", torch_compile=False)  # eager element-wise work in both
    full, lora = _estimate("full", **same), _estimate("lora", **same)
    backward = {k: e.time_s["compute"] - e.time_s["recompute"] for k, e in (("full", full), ("lora", lora))}
    assert backward["lora"] < 0.85 * backward["full"]  # with full recompute, the recompute term is the forward
    top = _estimate("lora", lora_layers=list(range(16, 32)))
    # half the layers recompute (their forward has half the adapters too)
    assert top.time_s["compute"] < lora.time_s["compute"] and top.time_s["recompute"] < 0.5 * lora.time_s["recompute"]
    assert lora.memory_bytes["activations"] > top.memory_bytes["activations"]
    qlora = _estimate("qlora")
    assert qlora.time_s["compute"] > lora.time_s["compute"]  # dequantisation, forward and backward
    assert lora.time_s["dp_comm"] <= full.time_s["dp_comm"]


def test_the_frozen_base_says_what_it_costs(cli):
    """Estimate.finetune splits the step's compute into the base's forward, the frozen layers' input gradients, the
    adapters and the dequantisation, which add up to the compute term (less the output layer's); explain prints it."""
    est = _estimate("qlora", lora_layers=list(range(16, 32)))
    f = est.finetune
    parts = f["base_forward_s"] + f["input_gradients_s"] + f["adapters_s"] + f["dequantisation_s"]
    assert parts < est.time_s["compute"] < 1.15 * parts  # the rest: the output layer and the loss
    assert f["layers_without_backward"] == 16 and f["weight_gradients_skipped_s"] > 0
    assert _estimate("full").finetune == {}
    out = cli(["explain", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
               "--finetune", "qlora", "--lora-layers", "16-31", "--dp", "8", "--zero", "1", "--recompute", "full"])
    assert "frozen base per step: forward" in out.output and "layers 0-15 run no backward" in out.output


def test_adapter_plans_are_data_parallel_only():
    bad = evaluate(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
                   finetune="lora", strategy=Strategy(dp=4, tp=2, zero_stage=0, micro_batch_size=1))
    assert not bad.valid and any("finetune 'lora'" in r and "tp 2" in r for r in bad.reasons)
    result = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
                  finetune="lora", top_k=3)
    assert result.plans and all(p.strategy.tp == p.strategy.pp == p.strategy.cp == 1 for p in result.plans)
    # the Hugging Face model checkpoints every layer or none: no selective or partial recompute is ranked
    every = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=64, seq_len=4096,
                 finetune="lora", framework="torchtitan", top_k=50)
    assert all(p.strategy.recompute in ("none", "full") and not p.strategy.recompute_num_layers for p in every.plans)
    assert result.train.framework == "deepspeed" and result.train.torch_compile is False


def test_plan_round_trips_through_json():
    from planner.specs import PlanResult
    result = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
                  finetune="qlora", lora_rank=32, lora_layers=[30, 31], top_k=2)
    back = PlanResult.model_validate_json(result.model_dump_json())
    assert back.train.lora_layers == [30, 31] and back.train.finetune == "qlora"
    pre = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096, top_k=1)
    assert PlanResult.model_validate_json(pre.model_dump_json()).train.finetune == "none"


def test_cli_qlora_70b_on_8_gpus_fits_and_full_finetuning_misses(cli):
    """The acceptance question: QLoRA of Llama 3 70B on one DGX H100 fits, with base weights, adapters and optimizer
    states as separate terms; full fine-tuning without an offloaded optimizer does not, and says by how much."""
    out = cli(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
                    "--finetune", "qlora", "--lora-rank", "16", "--format", "json"])
    assert out.exit_code == 0, out.output
    import json
    best = json.loads(out.stdout)["plans"][0]["estimate"]
    memory = best["memory_bytes"]
    assert memory["params"] > 0 and memory["adapters"] > 0 and memory["optimizer"] > 0
    assert best["fits"]
    explain = cli(["explain", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s",
                        "4096", "--finetune", "qlora", "--lora-rank", "16", "--dp", "8", "--zero", "3", "--recompute",
                        "full"])
    assert explain.exit_code == 0 and "adapters" in explain.output and "dequant_buffer" in explain.output
    table = cli(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
                 "--finetune", "qlora", "--lora-rank", "16", "--top", "2"])
    assert "QLoRA r16 (207.1M adapter parameters, deepspeed)" in table.output
    full = cli(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
                     "--finetune", "full", "-C", "offload_optimizer=false"])
    assert full.exit_code == 1
    assert "no strategy fits" in full.output and "GiB per GPU by" in full.output


@pytest.mark.parametrize("args, words", [
    (["--finetune", "lora", "--lora-rank", "0"], "lora_rank"),
    (["--finetune", "lora", "--lora-targets", "w_proj"], "lora_target_modules"),
    (["--finetune", "lora", "--lora-layers", "80"], "lora_layers names layer 80"),
    (["--lora-rank", "8"], "lora_rank needs finetune"),
    (["--finetune", "qlora", "--framework", "megatron"], "framework 'megatron'"),
    (["--finetune", "qlora", "--precision", "fp8"], "precision bf16 or fp16"),
    (["--finetune", "lora", "--lora-layers", "a-b"], "--lora-layers"),
])
def test_bad_finetune_input_is_one_line_exit_2(cli, args, words):
    out = cli(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
                    *args])
    assert out.exit_code == 2 and words in out.output and "Traceback" not in out.output
    assert len([line for line in out.output.splitlines() if line.startswith("error")]) == 1


def test_transformers_layers_are_the_llama_family_and_data_parallel(cli):
    """LoRA of a LayerNorm / plain-MLP model (GPT-3) is refused: the Hugging Face layer is costed for the Llama
    family's; model_code transformers needs DeepSpeed or FSDP2, adapters need model_code transformers; a full
    fine-tuning of Transformers' layers keeps its own (larger) activations and is data parallel only."""
    out = cli(["plan", "--model", "gpt3-1.7b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "2048",
               "--finetune", "lora", "--lora-targets", "up_proj"])
    assert out.exit_code == 2 and "LayerNorm (norm layernorm)" in out.output
    out = cli(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "-b", "16", "-s", "4096",
               "--model-code", "transformers", "--framework", "megatron"])
    assert out.exit_code == 2 and "model_code 'transformers' with framework 'megatron'" in out.output
    lora = TrainSpec(global_batch_size=1, seq_len=8, finetune="lora", model_code="framework")
    assert lora.model_code == "transformers" and lora.transformers  # adapters are always Transformers' layers
    hf = _estimate("full", model_code="transformers")
    own = _estimate("full", torch_compile=False)  # torchtitan's own Llama
    assert hf.memory_bytes["recompute_working"] > own.memory_bytes["recompute_working"]
    result = plan(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
                  finetune="full", model_code="transformers", top_k=5)
    assert result.train.framework == "deepspeed" and all(p.strategy.tp == 1 for p in result.plans)


def test_moe_adapters_are_refused():
    with pytest.raises(Exception, match="MoE model"):
        plan(model="mixtral-8x7b", cluster="dgx-h100", num_gpus=8, global_batch_size=16, seq_len=4096,
             finetune="lora")


def test_published_lora_memory_within_ten_percent():
    """Lit-GPT's LoRA and QLoRA rows (benchmarks/data/finetune_memory.json) within 10 %; every row's adapter count
    exact, and the QLoRA double-quantisation saving (nf4 against nf4-dq) within 0.05 GB of the published
    difference."""
    import json
    rows = json.loads(DATA.read_text())["rows"]
    predictions = [predict(r) for r in rows]
    for r, p in zip(rows, predictions):
        assert p["adapter_params"] == r["trainable_params"]
        assert abs(p["error"]) < 0.10, (r, p)
    by = {(r["model"], r["double_quant"]): (r, p) for r, p in zip(rows, predictions) if r["finetune"] == "qlora"}
    for model in ("llama2-7b", "llama2-13b"):
        (r0, p0), (r1, p1) = by[(model, False)], by[(model, True)]
        published = r0["max_gpu_ram_gb"] - r1["max_gpu_ram_gb"]
        assert abs((p0["predicted_gb"] - p1["predicted_gb"]) - published) < 0.05


def test_qlora_paper_65b_fits_48_gb():
    """The QLoRA paper's claim: LLaMA 65B fine-tunes on one 48 GB GPU."""
    from benchmarks.finetune_memory import QLORA_PAPER_LIMIT_GB, qlora_65b_peak
    tensors, peak = qlora_65b_peak()
    assert tensors < peak < QLORA_PAPER_LIMIT_GB


def test_nf4_bits():
    assert finetune.nf4_bytes_per_weight(True) * 8 == pytest.approx(4.127, abs=1e-3)
    assert np.isclose(finetune.nf4_bytes_per_weight(False) * 8, 4.5)
