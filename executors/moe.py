"""Mixture-of-experts MLP and expert parallelism with torch.distributed (imports torch).

The module tree of one MoE layer's MLP (`layers["<i>"].mlp`):

    router                 Linear h -> E (bias when `moe_router_bias`)
    experts["<e>"]         E routed experts, keyed by their global index, each an MLP
                           of width `moe_ffn_hidden_size` (gated when `gated_mlp`;
                           biases when `moe_expert_bias`)
    shared                 the `num_shared_experts` shared experts as one MLP of width
                           num_shared_experts · shared_expert_ffn_hidden_size, used by
                           every token (DeepSeekMoE's fused shared experts); None without

Routing (Mixtral; Megatron-core's default `softmax` score function without
pre-softmax, which is the same function): p = softmax(router(x)) over the E
experts (logits in the compute dtype, as both do by default; softmax in fp32),
the top-k experts by p, their weights p renormalised to sum to 1 (equal to a
softmax over the k selected logits). The output is Σ_k w_k ·
expert_k(x) (+ shared(x)). Dropless (no capacity factor, every routed token is
computed, Megatron-core's default) and no auxiliary load-balancing loss (its
default coefficient is 0): the loss is the language-model loss alone, so it does
not depend on how the batch is split over ranks.

Expert parallelism (`enable_expert_parallel`): ep rank j of an ep group keeps
experts [j·E/ep, (j+1)·E/ep) and deletes the others (every rank built all of them
from the seed, so the kept ones equal the reference's). Per MoE layer forward,
Megatron-core's all-to-all token dispatcher: the tokens' (token, expert) pairs are
sorted by expert; one all-to-all of the per-expert counts, one `all_to_all_single`
of the routed hidden vectors to the ranks holding their experts (uneven splits),
the local experts run on what they received, and a second `all_to_all_single`
returns the outputs to the tokens' ranks. Backward is the transposed exchange
(`AllToAll`). gloo implements `all_to_all_single` with uneven splits on CPU, so the
CPU runs use the same collective as NCCL.

Every expert runs on every step, also on zero tokens (an empty matmul), so every
expert parameter gets a gradient (zeros) on every rank, as the reference's do and
as the gradient reductions over the expert-data-parallel group expect.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from planner.specs import ModelSpec


#: ModelSpec.glu_activation -> the gate's activation (quick_gelu: x * sigmoid(1.702 x), gpt-oss's and megatron-core's)
GLU_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                   "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}


def glu_of(spec: ModelSpec) -> tuple[str, float, float | None]:
    """A model's gated-MLP activation: (gate activation, linear-branch offset, clamp or None)."""
    return spec.glu_activation, spec.glu_linear_offset, spec.glu_clamp


class MLP(nn.Module):
    """Plain (GELU) or gated MLP: w1 (and w3) h -> f, w2 f -> h. Gated: act(clamp(w1 x)) * (clamp(w3 x) + offset),
    the gate clamped to at most `clamp`, the linear branch to +- `clamp` (gpt-oss; no clamp by default)."""

    def __init__(self, hidden: int, ffn: int, gated: bool, bias: bool,
                 glu: tuple[str, float, float | None] = ("silu", 0.0, None)):
        super().__init__()
        self.gated = gated
        self.act, self.offset, self.clamp = GLU_ACTIVATIONS[glu[0]], glu[1], glu[2]
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        self.w3 = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.w2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.w1(x), self.w3(x)
            if self.clamp is not None:
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            return self.w2(self.act(gate) * (up + self.offset))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; backward sends the gradients back
    along the same routes (output and input splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class MoE(nn.Module):
    """Router, routed experts and optional shared experts (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, e = spec.hidden_size, spec.num_experts
        self.num_experts, self.top_k = e, spec.moe_top_k
        self.router = nn.Linear(h, e, bias=spec.moe_router_bias)
        self.experts = nn.ModuleDict({str(i): MLP(h, spec.expert_ffn, spec.gated_mlp, spec.moe_expert_bias, glu_of(spec))
                                      for i in range(e)})
        shared = spec.num_shared_experts * spec.shared_expert_ffn if spec.num_shared_experts else 0
        self.shared = MLP(h, shared, spec.gated_mlp, False, glu_of(spec)) if shared else None
        self.ep, self.ep_rank, self.ep_group = 1, 0, None

    def enable_expert_parallel(self, ep: int, ep_rank: int, group) -> None:
        """Keep only the experts of `ep_rank` (a contiguous E/ep block) and dispatch over `group`."""
        if self.num_experts % ep:
            raise ValueError(f"ep ({ep}) must divide num_experts ({self.num_experts})")
        per_rank = self.num_experts // ep
        keep = {str(i) for i in range(ep_rank * per_rank, (ep_rank + 1) * per_rank)}
        for name in list(self.experts.keys()):
            if name not in keep:
                del self.experts[name]
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, group

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (n, k) fp32 summing to 1 per token, expert indices (n, k))."""
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, k = tokens.shape[0], self.top_k
        weights, chosen = self.route(tokens)
        flat = chosen.reshape(-1)  # expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        routed = tokens.index_select(0, order // k)
        if self.ep == 1:
            out = self._local_experts(routed, counts.tolist())
        else:
            out = self._dispatched_experts(routed, counts)
        pairs = out.index_select(0, torch.argsort(order))  # back to (token, slot) order
        y = (pairs.view(n, k, -1) * weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(shape)

    def _local_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (in `self.experts` order), `counts[i]` rows for the i-th."""
        chunks = rows.split(counts)
        outs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]
        return torch.cat(outs) if outs else rows

    def _dispatched_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each routed row to the ep rank holding its expert, run the local experts, send back."""
        ep, per_rank = self.ep, self.num_experts // self.ep
        received_counts = torch.empty_like(counts)  # (source rank, local expert) counts
        dist.all_to_all_single(received_counts, counts, group=self.ep_group)
        send = counts.view(ep, per_rank).sum(dim=1).tolist()
        grid = received_counts.view(ep, per_rank)
        receive = grid.sum(dim=1).tolist()
        rows = AllToAll.apply(routed, receive, send, self.ep_group)  # ordered by (source rank, local expert)
        local_expert = torch.arange(per_rank, device=counts.device).repeat(ep).repeat_interleave(received_counts)
        by_expert = torch.argsort(local_expert, stable=True)
        out = self._local_experts(rows.index_select(0, by_expert), grid.sum(dim=0).tolist())
        out = out.index_select(0, torch.argsort(by_expert))  # back to (source rank, local expert) order
        return AllToAll.apply(out, send, receive, self.ep_group)


def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE MLPs of a (possibly partial) model, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Routed-expert parameters (what expert parallelism shards; reduced over the
    expert-data-parallel group). Router and shared experts are dense parameters."""
    return [p for m in moe_modules(model) for p in m.experts.parameters()]
