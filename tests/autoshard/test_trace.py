"""The operator-graph trace: kinds, FLOPs, parameters and wiring of the test models, Hugging Face models built from
their configs, repeated blocks, unknown ops, and the errors a module or its inputs can cause."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from planner.autoshard.ops import KINDS, OpNode  # noqa: E402
from planner.autoshard.trace import InputSpec, repeated_blocks, trace  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from tests.autoshard import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def tokens(batch: int, seq: int, vocab: int) -> tuple[InputSpec, InputSpec]:
    return InputSpec((batch, seq), "int64", vocab), InputSpec((batch, seq), "int64", vocab)


def ops(G: nx.DiGraph) -> list[OpNode]:
    return [G.nodes[n]["op"] for n in G.graph["order"]]


def kinds(G: nx.DiGraph) -> Counter:
    return Counter(op.kind for op in ops(G))


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def check_wiring(G: nx.DiGraph) -> None:
    """The graph's invariants: a DAG whose `order` is a topological order of all its nodes; each node's inputs
    are its predecessors, in argument order, with their output shapes; params are the module's."""
    order = G.graph["order"]
    assert sorted(order) == sorted(G) and len(set(order)) == len(order)
    assert nx.is_directed_acyclic_graph(G)
    index = {n: i for i, n in enumerate(order)}
    assert all(index[u] < index[v] for u, v in G.edges)
    for name in order:
        op = G.nodes[name]["op"]
        assert op.name == name and op.kind in KINDS
        assert set(op.inputs) == set(G.predecessors(name))
        assert op.input_tensors == tuple(G.nodes[p]["op"].output for p in op.inputs)
        assert sum(len(G.edges[p, name]["args"]) for p in set(op.inputs)) == len(op.inputs)
        for use in op.params:
            assert G.graph["params"][use.fqn] == use.tensor
        assert op.flop >= 0
    assert [G.nodes[n]["op"].kind for n in G.graph["inputs"]] == ["input"] * len(G.graph["inputs"])
    assert all(n in G for n in G.graph["outputs"])
    assert G.graph["unknown_ops"] == sorted({op.attrs["target"] for op in ops(G) if op.kind == "unknown"})


# -- GPT -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory, batch, seq", [(models.small_gpt, 2, 32), (models.gpt, 1, 1024)],
                         ids=["2-layer", "24-layer"])
def test_gpt_kinds_flops_params_and_order(factory, batch, seq):
    with torch.device("meta"):
        module = factory()
    G = trace(factory, tokens(batch, seq, module.wte.num_embeddings))
    check_wiring(G)
    found = kinds(G)
    for kind in ("input", "linear", "sdpa", "layer_norm", "embedding", "loss", "elementwise", "view", "permute"):
        assert found[kind] > 0, kind
    layers = len(module.blocks)
    assert found["sdpa"] == layers and found["linear"] == 6 * layers + 1 and found["layer_norm"] == 2 * layers + 1
    linear_params = sum(p.numel() for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    assert sum(op.flop for op in ops(G) if op.kind == "linear") == 2 * batch * seq * linear_params
    assert sum(t.nbytes for t in G.graph["params"].values()) == param_bytes(module)
    assert set(G.graph["params"]) == {n for n, _ in module.named_parameters()}
    assert G.graph["inputs"] == ["tokens", "labels"] and G.graph["outputs"] == ["cross_entropy_loss"]
    assert G.graph["unknown_ops"] == []
    sdpa = next(op for op in ops(G) if op.kind == "sdpa")
    heads, head_dim = module.blocks[0].attn.heads, module.wte.embedding_dim // module.blocks[0].attn.heads
    assert sdpa.attrs["causal"] is True and sdpa.input_tensors[0].shape == (batch, heads, seq, head_dim)
    assert sdpa.flop == 4 * batch * heads * seq * seq * head_dim / 2
    loss = G.nodes["cross_entropy_loss"]["op"]
    assert loss.kind == "loss" and loss.attrs["op"] == "cross_entropy" and loss.attrs["class_dim"] == 1
    assert loss.attrs["reduction"] == "mean" and loss.inputs == ("flatten", "flatten_1")
    assert loss.output.shape == ()


def test_gpt_nodes_say_where_they_ran_and_what_they_read():
    G = trace(models.small_gpt, tokens(2, 32, 128))
    fc1 = next(op for op in ops(G) if op.module == "blocks.1.mlp.fc1")
    assert fc1.kind == "linear" and fc1.module_type == "Linear" and fc1.output.shape == (2, 32, 256)
    assert [(p.fqn, p.role, p.arg, p.tensor.shape) for p in fc1.params] == [
        ("blocks.1.mlp.fc1.weight", "weight", 1, (256, 64)), ("blocks.1.mlp.fc1.bias", "bias", 2, (256,))]
    assert fc1.flop == 2 * 2 * 32 * 256 * (64 + 1)
    wte = next(op for op in ops(G) if op.module == "wte")
    assert wte.kind == "embedding" and wte.inputs == ("tokens",) and wte.params[0].fqn == "wte.weight"
    transpose = next(op for op in ops(G) if op.kind == "permute")
    assert transpose.attrs["dims"] == (0, 2, 1, 3) and transpose.flop == 0
    # the positions come from arange: a constant with no inputs, read by the position embedding
    wpe = next(op for op in ops(G) if op.module == "wpe")
    constant = G.nodes[wpe.inputs[0]]["op"]
    assert constant.kind == "elementwise" and constant.attrs["op"] == "constant" and constant.inputs == ()
    # the residual add reads both embeddings: argument positions on the edges
    add = next(op for op in ops(G) if op.attrs.get("op") == "add")
    assert [G.edges[p, add.name]["args"] for p in add.inputs] == [[0], [1]]
    assert G.graph["module_types"]["blocks.0"] == "Block"


# -- CNNs ------------------------------------------------------------------------------------------------------


def test_resnet50_conv_flops_match_the_analytic_count():
    """ResNet-50 does about 4.1 G multiply-adds per 224x224 image in its convolutions (He et al. 2016, table 1:
    3.8e9 FLOPs counting multiply-adds once, 4.1e9 in later counts with the projection shortcuts), so ~8.2e9 FLOP."""
    G = trace(models.resnet50, (InputSpec((2, 3, 224, 224)), InputSpec((2,), "int64", 1000)))
    check_wiring(G)
    found = kinds(G)
    assert found["conv2d"] == 53 and found["batch_norm"] == 53 and found["pool"] == 2 and found["linear"] == 1
    conv = sum(op.flop for op in ops(G) if op.kind == "conv2d")
    assert conv / 2 == pytest.approx(8.2e9, rel=0.03)
    # running statistics are buffers read by batch norm, and their in-place updates are gone
    bn = next(op for op in ops(G) if op.kind == "batch_norm")
    assert bn.attrs["buffers"] == {3: "bn.running_mean", 4: "bn.running_var"} and bn.attrs["training"] is True
    assert [p.role for p in bn.params] == ["weight", "bias"]
    assert not any(op.target.endswith(("add_.Tensor", "copy_.default")) for op in ops(G))
    assert not any("running" in fqn for fqn in G.graph["params"])
    assert "bn.running_mean" in G.graph["buffers"]
    pools = {op.attrs["op"]: op for op in ops(G) if op.kind == "pool"}
    assert pools["max"].attrs["kernel"] == (3, 3) and pools["max"].attrs["stride"] == (2, 2)
    assert pools["max"].attrs["padding"] == (1, 1)
    adaptive = pools["adaptive_avg"]
    assert adaptive.attrs["output_size"] == (1, 1) and adaptive.attrs["kernel"] == (7, 7)
    assert adaptive.output.shape == (2, 2048, 1, 1)
    stem = next(op for op in ops(G) if op.kind == "conv2d")
    assert stem.attrs == {"stride": (2, 2), "padding": (3, 3), "dilation": (1, 1), "groups": 1}


def test_small_cnn_real_weights_and_inputs_trace_without_touching_them():
    module = models.small_cnn()
    before = module.conv1.weight.detach().clone()
    G = trace(module, (torch.randn(4, 3, 32, 32), torch.zeros(4, dtype=torch.long)))
    check_wiring(G)
    assert torch.equal(module.conv1.weight, before)
    conv1 = next(op for op in ops(G) if op.kind == "conv2d")
    assert conv1.flop == 2 * 4 * 16 * 32 * 32 * (3 * 3 * 3 + 1)
    assert [op.kind for op in ops(G)] == ["input", "input", "conv2d", "elementwise", "pool", "conv2d",
                                          "elementwise", "pool", "view", "linear", "loss"]
    assert next(op for op in ops(G) if op.kind == "pool").attrs["kernel"] == (2, 2)
    assert repeated_blocks(G) == []


def test_a_real_module_in_training_keeps_its_running_statistics():
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    mean, count = module[1].running_mean.clone(), module[1].num_batches_tracked.clone()

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = module

        def forward(self, x):
            return self.net(x).sum()

    G = trace(Loss(), (torch.randn(2, 3, 8, 8),))
    assert torch.equal(module[1].running_mean, mean) and torch.equal(module[1].num_batches_tracked, count)
    assert kinds(G)["batch_norm"] == 1
    # a Sequential's children are numbered but of different classes: no repeated unit
    assert repeated_blocks(G) == []


def test_inputs_on_the_meta_device_and_a_meta_module_the_caller_owns():
    with torch.device("meta"):
        module = models.small_cnn()
    G = trace(module, (torch.empty(4, 3, 32, 32, device="meta"), torch.empty(4, dtype=torch.long, device="meta")))
    assert kinds(G)["conv2d"] == 2
    assert module.conv1.weight.is_meta  # the caller's module is left as it was


# -- repeated blocks -------------------------------------------------------------------------------------------


def test_repeated_blocks_of_a_24_layer_gpt_are_its_blocks_aligned():
    G = trace(models.gpt, tokens(1, 128, 50304))
    groups = repeated_blocks(G)
    assert len(groups) == 1 and len(groups[0]) == 24
    instances = groups[0]
    for i, nodes in enumerate(instances):
        assert all(G.nodes[n]["op"].module.startswith(f"blocks.{i}.") or G.nodes[n]["op"].module == f"blocks.{i}"
                   for n in nodes)
        assert [G.nodes[n]["op"].kind for n in nodes] == [G.nodes[n]["op"].kind for n in instances[0]]
        assert [G.nodes[n]["op"].flop for n in nodes] == [G.nodes[n]["op"].flop for n in instances[0]]
    assert len({n for nodes in instances for n in nodes}) == 24 * len(instances[0])
    order = G.graph["order"]
    assert all(order.index(a) < order.index(b) for nodes in instances for a, b in zip(nodes, nodes[1:]))
    # position i of every instance is the same parameter of its own block
    fc1 = [i for i, n in enumerate(instances[0]) if G.nodes[n]["op"].module.endswith("mlp.fc1")]
    assert [G.nodes[nodes[fc1[0]]]["op"].params[0].fqn for nodes in instances[:3]] == [
        f"blocks.{i}.mlp.fc1.weight" for i in range(3)]


def test_a_block_that_differs_is_left_out():
    with torch.device("meta"):
        module = models.small_gpt(layers=4)
        module.blocks[2] = models.Block(64, 4, 128)  # a narrower MLP: same class, other shapes
    G = trace(module, tokens(2, 32, 128))
    groups = repeated_blocks(G)
    assert len(groups) == 1 and len(groups[0]) == 3
    members = {G.nodes[n]["op"].module.split(".")[1] for nodes in groups[0] for n in nodes}
    assert members == {"0", "1", "3"}


def test_the_wiring_is_compared_not_only_the_ops():
    """Two blocks with the same ops in the same order but another argument order are not the same block."""

    class Swap(nn.Module):
        def __init__(self, swap: bool) -> None:
            super().__init__()
            self.a, self.b, self.swap = nn.Linear(8, 8), nn.Linear(8, 8), swap

        def forward(self, x):
            a, b = self.a(x), self.b(x)
            return torch.sub(b, a) if self.swap else torch.sub(a, b)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Swap(False), Swap(False), Swap(True)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    G = trace(Net(), (torch.zeros(2, 8),))
    groups = repeated_blocks(G)
    assert [len(g) for g in groups] == [2]
    assert {G.nodes[n]["op"].module.split(".")[1] for n in groups[0][1]} == {"1"}


def test_resnet_stages_give_one_group_each():
    G = trace(models.resnet50, (InputSpec((1, 3, 64, 64)), InputSpec((1,), "int64", 1000)))
    groups = repeated_blocks(G)
    assert [len(g) for g in groups] == [2, 3, 5, 2]  # every stage's blocks after its first (which projects)
    assert {G.nodes[g[0][0]]["op"].module.split(".")[1] for g in groups} == {"1", "4", "8", "14"}


# -- Hugging Face ----------------------------------------------------------------------------------------------


def hf_configs():
    transformers = pytest.importorskip("transformers")
    return [transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False),
            transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=128, use_cache=False)]


@pytest.mark.parametrize("index", [0, 1], ids=["gpt2", "llama"])
def test_hugging_face_models_from_their_configs(index):
    import transformers

    config = hf_configs()[index]
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config)
    ids = {"input_ids": InputSpec((2, 16), "int64", 128), "labels": InputSpec((2, 16), "int64", 128)}
    G = trace(lambda: transformers.AutoModelForCausalLM.from_config(config), (), ids)
    check_wiring(G)
    found = kinds(G)
    assert found["embedding"] >= 1 and found["sdpa"] == 2 and found["loss"] == 1
    assert found["linear" if index else "matmul"] >= 8  # GPT-2's Conv1D is addmm: a matmul against parameters
    assert G.graph["inputs"] == ["input_ids", "labels"]
    assert [G.nodes[n]["op"].attrs.get("keyword") for n in G.graph["inputs"]] == ["input_ids", "labels"]
    assert G.graph["outputs"][0] == "cross_entropy_loss"
    assert sum(t.nbytes for t in G.graph["params"].values()) == param_bytes(module)
    groups = repeated_blocks(G)
    assert len(groups) == 1 and len(groups[0]) == 2
    if index == 0:
        # the tied vocabulary: one parameter, read by the token embedding and by the head
        readers = [op for op in ops(G) if any(p.fqn == "transformer.wte.weight" for p in op.params)]
        assert sorted(op.kind for op in readers) == ["embedding", "linear"]
        addmm = next(op for op in ops(G) if op.attrs.get("op") == "addmm")
        assert [(p.role, p.arg) for p in addmm.params] == [("weight", 1), ("bias", 2)]
        assert addmm.flop == 2 * 32 * 192 * (64 + 1)
        pieces = [op for op in ops(G) if op.kind == "slice" and op.module == "transformer.h.0.attn"]
        assert [(op.attrs["start"], op.attrs["stop"]) for op in pieces] == [(0, 64), (64, 128), (128, 192)]


def test_a_wrapper_module_returning_the_loss():
    import transformers

    config = hf_configs()[0]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(config)

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    G = trace(Wrapped, tokens(2, 16, 128))
    assert G.graph["outputs"] == ["cross_entropy_loss"] and G.graph["inputs"] == ["input_ids", "labels"]
    assert len(repeated_blocks(G)[0]) == 2


# -- op coverage -----------------------------------------------------------------------------------------------


class Pieces(nn.Module):
    """split, chunk, unbind, select, a matmul against a parameter, a masked non-causal attention, rms_norm,
    softmax and tied weights in one module."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 12)
        self.w = nn.Parameter(torch.randn(12, 12))
        self.head = nn.Linear(12, 16, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.Parameter(torch.ones(12))

    def forward(self, idx, mask):
        x = self.emb(idx)  # (2, 5, 12)
        q, k, v = (x @ self.w).split(4, dim=-1)
        a, b = q.chunk(2, dim=1)
        first, second = k.unbind(0)[:2]
        y = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), attn_mask=mask)
        z = F.rms_norm(torch.cat([y.squeeze(1)] * 3, dim=-1), (12,), self.norm)
        logits = self.head(z).softmax(-1)
        return logits.sum() + a.sum() + b.mean() + (first * second).sum() + x[:, 0].sum()


def test_pieces_mask_matmul_rms_norm_and_tied_weights():
    G = trace(Pieces(), (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 1, 5, 5, dtype=torch.bool)))
    check_wiring(G)
    by_kind: dict[str, list[OpNode]] = {}
    for op in ops(G):
        by_kind.setdefault(op.kind, []).append(op)
    matmul = by_kind["matmul"][0]
    assert [(p.fqn, p.arg) for p in matmul.params] == [("w", 1)] and matmul.flop == 2 * 2 * 5 * 12 * 12
    slices = {(op.attrs["dim"], op.attrs["start"], op.attrs["stop"], op.output.shape) for op in by_kind["slice"]}
    assert {(2, 0, 4, (2, 5, 4)), (2, 4, 8, (2, 5, 4)), (2, 8, 12, (2, 5, 4))} <= slices  # split
    assert {(1, 0, 3, (2, 3, 4)), (1, 3, 5, (2, 2, 4))} <= slices  # chunk
    assert {(0, 0, 1, (1, 5, 4)), (0, 1, 2, (1, 5, 4)), (1, 0, 1, (2, 1, 12))} <= slices  # unbind, select
    for piece in [op for op in by_kind["slice"] if op.name.endswith(".slice")]:  # dropped dims: slice + view
        (view,) = G.successors(piece.name)
        assert G.nodes[view]["op"].kind == "view" and view == piece.name.removesuffix(".slice")
    sdpa = by_kind["sdpa"][0]
    assert len(sdpa.inputs) == 4 and sdpa.inputs[3] == "mask" and sdpa.attrs["causal"] is False
    assert sdpa.flop == 4 * 2 * 1 * 5 * 5 * 4
    assert by_kind["rms_norm"][0].attrs["normalized_ndim"] == 1
    assert by_kind["rms_norm"][0].params[0].fqn == "norm"
    assert by_kind["softmax"][0].attrs == {"op": "softmax", "dim": 2}
    assert by_kind["cat"][0].attrs["dim"] == 2 and len(by_kind["cat"][0].inputs) == 3
    tied = [op.kind for op in ops(G) if any(p.fqn == "emb.weight" for p in op.params)]
    assert sorted(tied) == ["embedding", "linear"] and "head.weight" not in G.graph["params"]
    assert G.graph["unknown_ops"] == []


def test_an_op_outside_the_vocabulary_is_unknown_and_listed():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = torch.cumsum(self.fc(x), dim=1)
            values, _ = torch.sort(y, dim=-1)
            return F.mse_loss(values, y, reduction="sum") + y.max(dim=1).values.sum()

    G = trace(Odd(), (InputSpec((3, 4)),))
    check_wiring(G)
    assert G.graph["unknown_ops"] == ["aten.cumsum.default", "aten.sort.default"]
    sort = next(op for op in ops(G) if op.kind == "unknown" and "sort" in op.target)
    assert sort.name == "sort" and sort.output.shape == (3, 4)  # one node for the used output
    (loss,) = [op for op in ops(G) if op.kind == "loss"]
    assert loss.attrs["op"] == "mse_loss" and loss.attrs["reduction"] == "sum"
    broadcast = [G.nodes[n]["op"] for n in loss.inputs]  # F.mse_loss broadcasts its operands first
    assert [(op.kind, op.attrs["op"], op.inputs) for op in broadcast] == [
        ("elementwise", "expand", ("sort",)), ("elementwise", "expand", ("cumsum",))]
    (amax,) = [op for op in ops(G) if op.kind == "reduce" and op.attrs["op"] == "amax"]
    assert amax.attrs["dims"] == (1,) and amax.output.shape == (3,) and amax.target == "aten.max.dim"
    assert amax.name == "max_1" and amax.inputs == (broadcast[1].name,)  # export reuses the broadcast y


# -- errors ----------------------------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x).sum()
        return x.sum()


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message and len(message) < 400
    return message


def test_data_dependent_control_flow_cannot_be_traced():
    with pytest.raises(SpecError) as error:
        trace(Branchy, (InputSpec((2, 4)),))
    message = one_line(error)
    assert message.startswith("module: cannot be traced") and "tensor values" in message
    assert "test_trace.py" in message and "if x.sum() > 0:" in message  # the module's own line


class Boxed:
    def __init__(self, value) -> None:
        self.value = value


class ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Boxed(self.fc(x))


class MasksByValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)[x[:, 0] > 0].sum()


def test_what_export_refuses_and_value_dependent_shapes():
    with pytest.raises(SpecError) as error:
        trace(ReturnsAnObject, (InputSpec((2, 4)),))
    assert one_line(error).startswith("module: torch.export cannot trace it: RuntimeError: Found")
    with pytest.raises(SpecError) as error:
        trace(MasksByValue, (InputSpec((2, 4)),))
    assert one_line(error).startswith("module: cannot be traced: its forward depends on tensor values")


@pytest.mark.parametrize("factory, inputs, reason", [
    (models.small_cnn, (InputSpec((4, 3, 30, 30)), InputSpec((4,), "int64", 10)), "must have same reduction dim"),
    (models.small_gpt, tokens(4, 77, 128), "positions 0..76 index the embedding wpe of 32 rows"),
    (models.resnet50, (InputSpec((2, 4, 64, 64)), InputSpec((2,), "int64")), "channels"),
], ids=["cnn-image-size", "gpt-too-long", "resnet-channels"])
def test_inputs_that_do_not_fit_the_module(factory, inputs, reason):
    with pytest.raises(SpecError) as error:
        trace(factory, inputs)
    message = one_line(error)
    shapes = ", ".join(str(i.shape) for i in inputs)
    assert message.startswith(f"input_shape: {shapes} does not fit the module: ") and reason in message


def test_bad_inputs_and_modules_are_spec_errors():
    with pytest.raises(SpecError, match="unknown input dtype 'flaot32'; close matches: float32"):
        InputSpec((2, 4), "flaot32")
    with pytest.raises(SpecError, match="input shape: expected a tuple of positive integers"):
        InputSpec((2, 0))
    with pytest.raises(SpecError, match="input high: only integer inputs"):
        InputSpec((2,), "float32", high=3)
    with pytest.raises(SpecError, match=r"example_inputs\[0\]: expected a tensor or an InputSpec, got list"):
        trace(models.small_cnn, ([4, 3, 32, 32],))
    with pytest.raises(SpecError, match="unknown input dtype 'complex64'"):
        trace(models.small_cnn, (torch.zeros(4, 3, 32, 32, dtype=torch.complex64),))
    with pytest.raises(SpecError, match="module: expected an nn.Module"):
        trace(42, (InputSpec((1,)),))
    with pytest.raises(SpecError, match="module: the callable returned int"):
        trace(lambda: 3, (InputSpec((1,)),))
    with pytest.raises(SpecError, match="module: building it on the meta device failed: ZeroDivisionError"):
        trace(lambda: 1 / 0, (InputSpec((1,)),))


def test_tracing_prints_nothing(capfd):
    trace(models.small_gpt, tokens(2, 32, 128))
    with pytest.raises(SpecError):
        trace(Branchy, (InputSpec((2, 4)),))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_importing_the_trace_does_not_import_torch():
    code = ("import sys; import planner.autoshard.trace as t; "
            "t.InputSpec((2, 3), 'int64', 7); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_flops_of_a_graph_are_finite_and_views_are_free():
    G = trace(models.small_gpt, tokens(2, 32, 128))
    assert all(math.isfinite(op.flop) for op in ops(G))
    assert all(op.flop == 0 for op in ops(G) if op.kind in ("view", "permute", "slice", "input", "embedding"))
    layer_norm = next(op for op in ops(G) if op.kind == "layer_norm")
    assert layer_norm.flop == 8 * layer_norm.output.numel
