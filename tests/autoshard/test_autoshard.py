"""Graph auto-parallel end to end: traced models solved on simulated clusters, Megatron's layout rediscovered,
agreement with the transformer planner, pipeline stages, repeated blocks, and the refusals."""

from __future__ import annotations

import json
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from planner import ModelSpec, evaluate  # noqa: E402
from planner.autoshard import solver as solver_module  # noqa: E402
from planner.autoshard.api import autoshard  # noqa: E402
from planner.autoshard.trace import InputSpec, trace  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from tests.autoshard import models  # noqa: E402

GIB = 2**30

# CPU-heavy solves: run on the worker that runs the executors' multi-process tests, one after another, so they
# never compete with a timed run for the two cores (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("processes")


class TransposedWeights(torch.nn.Module):
    """Linears written as `addmm(b, x, w.t())` and `mm(h, w2.t())`: the weights reach the GEMMs through a
    transpose of the parameter (as a decomposed linear is traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4096, 1024))
        self.b = torch.nn.Parameter(torch.zeros(4096))
        self.w2 = torch.nn.Parameter(torch.randn(1024, 4096))

    def forward(self, x):
        h = torch.addmm(self.b, x, self.w.t())
        return torch.mm(torch.relu(h), self.w2.t()).pow(2).mean()


def tokens(b: int, s: int, vocab: int) -> tuple[InputSpec, InputSpec]:
    return InputSpec((b, s), "int64", vocab), InputSpec((b, s), "int64", vocab)


@pytest.fixture(scope="module")
def block_graph():
    return trace(lambda: models.gpt_block(4096, 32), (InputSpec((8, 2048, 4096)),))


def linear_layouts(result, axis: int) -> dict[str, str]:
    """Each linear's module -> its strategy on one mesh axis."""
    return {n.module: n.strategy.split("|")[axis] for n in result.nodes if n.kind == "linear"}


def test_rediscovers_megatron_layout_on_the_fast_axis(block_graph):
    """Parameters replicated need 3.4 GiB; a 1.5 GiB budget forces sharding. On 2 nodes of 8 GPUs (an NVLink axis
    of 8 inside a node, an InfiniBand axis of 2 across), the solver splits Q, K, V and the first MLP linear by
    columns and the attention output and second MLP linear by rows on the NVLink axis: Megatron's layout (the
    rows with a reduce-scatter to the sequence are Megatron's sequence parallelism)."""
    result = autoshard(None, None, "dgx-h100", 16, memory_budget_bytes=1.5 * GIB, mesh_shape=(8, 2),
                       graph=block_graph)
    inner = linear_layouts(result, 0)
    for name in ("block.attn.q", "block.attn.k", "block.attn.v", "block.mlp.fc1"):
        assert inner[name] == "column", (name, inner)
    for name in ("block.attn.proj", "block.mlp.fc2"):
        assert inner[name].startswith("row"), (name, inner)
    assert result.params["block.attn.q.weight"][0] == "Shard(0)"
    assert result.params["block.mlp.fc2.weight"][0] == "Shard(1)"
    assert result.peak_memory_bytes <= 1.5 * GIB and result.optimal
    assert result.mesh_axes[0].startswith("8 devices over intra-node") and "inter-node" in result.mesh_axes[1]


def test_step_time_agrees_with_the_transformer_planner():
    """A GPT traced from PyTorch and the same GPT described to the transformer planner, both at tp 8 on one DGX
    H100: the two predictions are within 10 %. The graph prices every op as its own kernel (eager PyTorch);
    the transformer planner prices Megatron's fused kernels."""
    layers, hidden, heads, vocab, seq = 4, 4096, 32, 50304, 2048
    graph = trace(lambda: models.GPT(layers, hidden, heads, vocab, seq), tokens(1, seq, vocab))
    result = autoshard(None, None, "dgx-h100", 8, mesh_shape=(8,), graph=graph)
    strategies = Counter(n.strategy for n in result.nodes if n.kind == "linear")
    assert strategies == {"column": 4 * layers + 1, "row": 2 * layers}  # Q, K, V, fc1 and the head; proj, fc2
    spec = ModelSpec(name="zoo-gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=4 * hidden, gated_mlp=False, vocab_size=vocab, tie_embeddings=False,
                     position_embedding="learned", max_position_embeddings=seq, norm="layernorm",
                     linear_bias=True, qkv_bias=True, dropout=False, mlp_activation="gelu")
    with pytest.warns(Warning):
        planned = evaluate(spec, "dgx-h100", 8, 1, seq, strategy=dict(tp=8, micro_batch_size=1),
                           strict_numerics=True)
    assert result.step_time_s == pytest.approx(planned.step_time_s, rel=0.10)


def test_gpt_24_layers_on_8_devices_solves_its_blocks_once():
    graph = trace(models.gpt, tokens(8, 1024, 50304))
    result = autoshard(None, None, "dgx-h100", 8, graph=graph)
    assert result.solver == "milp (repeated blocks)" and result.optimal
    assert "24 x" in result.solver_note and "proven optimal" in result.solver_note
    with torch.device("meta"):
        names = {name for name, _ in models.gpt().named_parameters()}
    assert set(result.params) == names
    assert all(len(p) == len(result.mesh_shape) for p in result.params.values())
    assert result.peak_memory_bytes <= result.memory_budget_bytes


@pytest.mark.parametrize("budget_gib", [None, 0.05])
def test_repeated_blocks_answer_is_the_whole_programs(budget_gib):
    """Solved once per run of blocks (when the bound proves it) or not, the plan costs the same as the integer
    program over the whole graph; with a budget that binds, the reduction may not prove itself and the whole
    graph is solved."""
    graph = trace(lambda: models.gpt(layers=4, hidden=256, heads=4, vocab=1024, seq_len=128), tokens(8, 128, 1024))
    budget = None if budget_gib is None else budget_gib * GIB
    # the whole program takes HiGHS seconds to prove; a generous limit keeps a busy machine from cutting the
    # proof short (the test is about the answers agreeing, not about the solver's speed: benchmarks/autoshard_speed)
    limit = 600.0
    reduced = autoshard(None, None, "dgx-h100", 4, graph=graph, memory_budget_bytes=budget, time_limit_s=limit)
    full = autoshard(None, None, "dgx-h100", 4, graph=graph, memory_budget_bytes=budget, reuse_blocks=False,
                     time_limit_s=limit)
    assert full.solver == "milp" and full.optimal and reduced.optimal
    assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=1e-6)


def test_resnet50_on_8_devices():
    graph = trace(models.resnet50, (InputSpec((256, 3, 224, 224)), InputSpec((256,), "int64", 1000)))
    result = autoshard(None, None, "dgx-h100", 8, graph=graph)
    kinds = Counter(n.kind for n in result.nodes)
    assert kinds["conv2d"] == 53 and kinds["batch_norm"] == 53
    assert result.inputs[0][0] == "Shard(0)"  # the images are split by batch
    assert result.step_time_s > 0 and result.peak_memory_bytes <= result.memory_budget_bytes
    assert not result.unknown_ops


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models_built_from_their_configs(family):
    """A transformers model from its config on the meta device (no weights): traced and solved; the op the
    strategies do not know (the loss's label shift, aten.pad) is kept replicated and listed."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128,
                                         use_cache=False)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=512, vocab_size=1024,
                                          use_cache=False)
    ids = {"input_ids": InputSpec((8, 128), "int64", 1024), "labels": InputSpec((8, 128), "int64", 1024)}
    result = autoshard(lambda: transformers.AutoModelForCausalLM.from_config(config), (), "dgx-h100", 8,
                       example_kwargs=ids)
    assert result.solver == "milp (repeated blocks)" and result.optimal
    assert result.unknown_ops == ["aten.pad.default"]
    assert len(result.inputs) == 2 and result.step_time_s > 0


def test_pipeline_stages_are_contiguous_and_fit():
    graph = trace(lambda: models.gpt(layers=8, hidden=2048, heads=16, seq_len=1024), tokens(4, 1024, 50304))
    result = autoshard(None, None, "dgx-h100", 8, pp=2, graph=graph, memory_budget_bytes=20 * GIB)
    assert result.pp == 2 and result.micro_batches == 4 and result.mesh_shape in ([4], [2, 2])
    assert [s.index for s in result.stages] == [0, 1]
    stage_of = [n.stage for n in result.nodes]
    assert stage_of == sorted(stage_of) and set(stage_of) == {0, 1}
    assert sum(s.num_nodes for s in result.stages) == len(result.nodes)
    assert result.stages[0].send_bytes > 0 and result.stages[1].send_bytes == 0
    assert all(s.memory_bytes <= 20 * GIB for s in result.stages)
    assert result.time_s["pp_bubble"] > 0
    # the cut crosses one hidden state (a residual stream), never more
    assert result.stages[0].send_bytes <= 4 * 1024 * 2048 * 2


def test_weights_transposed_before_their_gemm_are_split_through_the_transpose():
    graph = trace(TransposedWeights, (InputSpec((64, 1024)),))
    result = autoshard(None, None, "dgx-h100", 4, graph=graph, memory_budget_bytes=0.15 * GIB)
    transposes = [n for n in result.nodes if n.kind == "permute" and n.params]
    assert len(transposes) == 2 and result.peak_memory_bytes <= 0.15 * GIB
    for node in transposes:  # the parameter's split and its transpose's output agree
        (placement,) = node.params.values()
        assert placement != ["Replicate()"]  # the budget forces the weights apart
        dim = int(placement[0][6])
        assert node.output == [f"Shard({1 - dim})"]


def test_heuristic_for_graphs_too_large(monkeypatch):
    graph = trace(models.small_gpt, tokens(4, 32, 128))
    exact = autoshard(None, None, "dgx-h100", 4, graph=graph, reuse_blocks=False)
    monkeypatch.setattr("planner.autoshard.api.MILP_MAX_VARIABLES", 10)
    rough = autoshard(None, None, "dgx-h100", 4, graph=graph, reuse_blocks=False)
    assert rough.solver == "heuristic" and not rough.optimal and "exceed" in rough.solver_note
    assert rough.step_time_s >= exact.step_time_s * (1 - 1e-9)
    assert solver_module.MILP_MAX_VARIABLES > 10


def test_nothing_fits_names_the_smallest_memory(block_graph):
    with pytest.raises(SpecError, match=r"^memory_budget_bytes: no sharding fits 0.01 GiB per device; the "
                                         r"smallest memory found is [0-9.]+ GiB per device$"):
        autoshard(None, None, "dgx-h100", 8, memory_budget_bytes=0.01 * GIB, graph=block_graph)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=0), "num_gpus: must be a positive integer"),
    (dict(num_gpus=8, pp=3), "pp: 3 must divide num_gpus"),
    (dict(num_gpus=8, mesh_shape=(3, 2)), "mesh_shape: [3, 2] must be one or two positive sizes"),
    (dict(num_gpus=8, precision="fp8"), "precision: must be one of bf16, fp16, fp32"),
])
def test_bad_arguments(block_graph, kwargs, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        autoshard(None, None, "dgx-h100", graph=block_graph, **kwargs)


def test_cli_json(capsys):
    code = main(["autoshard", "tests.autoshard.models:small_gpt", "--input-shape", "4,32:int64:128",
                 "--input-shape", "4,32:int64:128", "--cluster", "local-cpu", "--gpus", "2", "--precision", "fp32",
                 "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert result["num_gpus"] == 2 and result["params"]["wte.weight"]
    assert result["solve_time_s"] > 0 and result["nodes"]


def test_cli_table_and_factory_args(capsys):
    code = main(["autoshard", "tests.autoshard.models:small_gpt", "-i", "4,32:int64:128", "-i", "4,32:int64:128",
                 "--factory-arg", "layers=3", "--gpus", "4", "--pp", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "pipeline stages" in out and "blocks.*.attn.q.weight" in out and "predicted step" in out


@pytest.mark.parametrize("argv, message", [
    (["os:system", "-i", "4"], "factory: 'os' is a standard-library module, not a model's"),
    (["tests.autoshard.graphs:OpNode", "-i", "4"], "factory: 'OpNode' is not defined in 'tests.autoshard.graphs'"),
    (["not a path", "-i", "4"], "factory: 'not a path' must be package.module:function"),
    (["tests.autoshard.test_trace:Branchy", "-i", "2,4"], "module: cannot be traced"),
    (["tests.autoshard.models:small_gpt", "-i", "4,x"], "input_shape: '4,x' must be positive integers"),
    (["tests.autoshard.models:small_gpt", "-i", "4,32:int64:128", "-i", "4,33:int64:128"], "input_shape"),
    (["tests.autoshard.models:small_gpt", "-i", "4,32:int64:128", "-i", "4,32:int64:128", "--factory-arg",
      "bogus=1"], "--factory-arg: tests.autoshard.models:small_gpt does not take these arguments"),
    (["tests.autoshard.models:small_gpt", "-i", "4,32:int64:128", "-i", "4,32:int64:128", "--memory-gib", "0.000001"],
     "memory_budget_bytes: no sharding fits"),
])
def test_cli_bad_input_is_one_line(capsys, argv, message):
    code = main(["autoshard", *argv, "--cluster", "local-cpu", "--gpus", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
