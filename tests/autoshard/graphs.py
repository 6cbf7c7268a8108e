"""Operator graphs written by hand (no torch): a GPT block as Megatron's layers compute it, and chains of them,
for testing the strategies and the solver apart from the tracer."""

from __future__ import annotations

import networkx as nx

from planner.autoshard.ops import OpNode, ParamUse, Tensor

F32 = "float32"


class GraphBuilder:
    def __init__(self) -> None:
        self.g = nx.DiGraph()
        self.order: list[str] = []
        self.params: dict[str, Tensor] = {}

    def add(self, name: str, kind: str, inputs: list[str], shape: tuple[int, ...], params=(), module: str = "",
            dtype: str = F32, flop: float = 0.0, **attrs) -> str:
        ins = tuple(inputs)
        tensors = tuple(self.g.nodes[i]["op"].output for i in ins)
        uses = []
        for fqn, pshape, role, *arg in params:
            t = Tensor(tuple(pshape), F32)
            self.params[fqn] = t
            uses.append(ParamUse(fqn, t, role, arg[0] if arg else 1))
        op = OpNode(name, kind, f"test.{kind}", ins, tensors, Tensor(tuple(shape), dtype), tuple(uses), flop,
                    module, "", dict(attrs))
        self.g.add_node(name, op=op)
        for pos, i in enumerate(ins):
            if self.g.has_edge(i, name):
                self.g.edges[i, name]["args"].append(pos)
            else:
                self.g.add_edge(i, name, args=[pos])
        self.order.append(name)
        return name

    def done(self, inputs: list[str], outputs: list[str]) -> nx.DiGraph:
        self.g.graph.update(inputs=inputs, outputs=outputs, order=list(self.order), params=dict(self.params),
                            unknown_ops=[])
        return self.g


def block(gb: GraphBuilder, x: str, prefix: str, b: int, s: int, h: int, heads: int) -> str:
    """A pre-norm GPT block on x [b, s, h] with separate q, k, v projections (nodes named prefix + ...)."""
    d = h // heads
    p = prefix
    ln1 = gb.add(f"{p}ln1", "layer_norm", [x], (b, s, h), [(f"{p}ln1.weight", (h,), "weight"),
                                                           (f"{p}ln1.bias", (h,), "bias")], f"{p}ln1",
                 normalized_ndim=1)
    heads_t = []
    for n in "qkv":
        lin = gb.add(f"{p}{n}", "linear", [ln1], (b, s, h), [(f"{p}attn.{n}.weight", (h, h), "weight"),
                                                             (f"{p}attn.{n}.bias", (h,), "bias")], f"{p}attn.{n}")
        view = gb.add(f"{p}{n}_view", "view", [lin], (b, s, heads, d), module=f"{p}attn")
        heads_t.append(gb.add(f"{p}{n}_t", "permute", [view], (b, heads, s, d), module=f"{p}attn",
                              dims=(0, 2, 1, 3)))
    att = gb.add(f"{p}sdpa", "sdpa", heads_t, (b, heads, s, d), module=f"{p}attn", causal=True)
    back = gb.add(f"{p}att_t", "permute", [att], (b, s, heads, d), module=f"{p}attn", dims=(0, 2, 1, 3))
    merged = gb.add(f"{p}att_view", "view", [back], (b, s, h), module=f"{p}attn")
    proj = gb.add(f"{p}proj", "linear", [merged], (b, s, h), [(f"{p}attn.proj.weight", (h, h), "weight"),
                                                              (f"{p}attn.proj.bias", (h,), "bias")],
                  f"{p}attn.proj")
    res1 = gb.add(f"{p}res1", "elementwise", [x, proj], (b, s, h), module=p.rstrip("."), op="add")
    ln2 = gb.add(f"{p}ln2", "layer_norm", [res1], (b, s, h), [(f"{p}ln2.weight", (h,), "weight"),
                                                              (f"{p}ln2.bias", (h,), "bias")], f"{p}ln2",
                 normalized_ndim=1)
    fc1 = gb.add(f"{p}fc1", "linear", [ln2], (b, s, 4 * h), [(f"{p}mlp.fc1.weight", (4 * h, h), "weight"),
                                                             (f"{p}mlp.fc1.bias", (4 * h,), "bias")], f"{p}mlp.fc1")
    act = gb.add(f"{p}gelu", "elementwise", [fc1], (b, s, 4 * h), module=f"{p}mlp", op="gelu")
    fc2 = gb.add(f"{p}fc2", "linear", [act], (b, s, h), [(f"{p}mlp.fc2.weight", (h, 4 * h), "weight"),
                                                         (f"{p}mlp.fc2.bias", (h,), "bias")], f"{p}mlp.fc2")
    return gb.add(f"{p}res2", "elementwise", [res1, fc2], (b, s, h), module=p.rstrip("."), op="add")


def gpt_block_graph(b: int = 1, s: int = 2048, h: int = 4096, heads: int = 32, layers: int = 1) -> nx.DiGraph:
    """`layers` blocks on an input x [b, s, h], loss = mean of the output's squares."""
    gb = GraphBuilder()
    x = gb.add("x", "input", [], (b, s, h), index=0)
    for i in range(layers):
        x = block(gb, x, f"blocks.{i}.", b, s, h, heads)
    sq = gb.add("square", "elementwise", [x], (b, s, h), op="pow")
    loss = gb.add("loss", "reduce", [sq], (), op="mean", dims=(0, 1, 2), keepdim=False)
    return gb.done(["x"], [loss])


def block_groups(graph: nx.DiGraph, layers: int) -> list[list[list[str]]]:
    """The blocks of `gpt_block_graph` as one group of aligned instances."""
    order = graph.graph["order"]
    insts = [[n for n in order if n.startswith(f"blocks.{i}.")] for i in range(layers)]
    return [insts] if layers > 1 else []
