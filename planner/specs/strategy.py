"""Strategy: one point of the search space.

Rank layout follows Megatron-core: tp is innermost, then cp, then dp, then pp
outermost (ep and etp subdivide the data/tensor parallel ranks of expert
layers). A 16-GPU worked example with tp=2, dp=2, pp=4: ranks 0-1 form TP group
0, ranks {0,2} a DP group, and ranks {0,4,8,12} one pipeline.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from planner.errors import SpecError
from planner.specs.base import MAX_BATCH, MAX_GPUS, MAX_LAYERS, Spec

Recompute = Literal["none", "selective", "full"]
#: Megatron-core's `--recompute-modules` names, in the order `StrategyArrays.recompute_modules`
#: holds them as a bit mask (bit i = RECOMPUTE_MODULES[i]).
#: The rank orders a strategy may take, innermost dimension first: Megatron-core's default (tp, then cp, then
#: the data-parallel ranks, pipeline outermost; torchtitan's, DeepSpeed's and Colossal-AI's meshes nest the same
#: way), and Megatron's --use-tp-pp-dp-mapping (pipeline inside data parallelism: the stages of one pipeline sit
#: close together and the data-parallel replicas far apart, the order of Llama 3's training, [TP, CP, PP, DP]).
RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "shared_experts", "moe")


class Strategy(Spec):
    """Parallel degrees, ZeRO stage, micro-batch and recomputation of one training run."""

    dp: int | Literal["auto"] = Field("auto", description="Data parallel degree; 'auto' = GPUs / (tp·cp·pp).")
    tp: int = Field(1, ge=1, le=MAX_GPUS, description="Tensor (model) parallel degree.")
    pp: int = Field(1, ge=1, le=MAX_GPUS, description="Pipeline parallel degree (stages).")
    cp: int = Field(1, ge=1, le=MAX_GPUS, description="Context parallel degree (sequence split across ranks in attention).")
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="Expert parallel degree (MoE layers only; 1 for dense models).")
    etp: int = Field(1, ge=1, le=MAX_GPUS, description="Tensor parallel degree inside experts (MoE layers only).")
    vpp: int = Field(1, ge=1, le=MAX_GPUS, description="Virtual pipeline chunks per stage (interleaved 1F1B); 1 = plain 1F1B.")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism inside the TP group (needs tp > 1).")
    zero_stage: int = Field(
        0, ge=0, le=3,
        description="0: replicated optimizer; 1: optimizer states sharded over dp (Megatron distributed optimizer); "
        "2: + gradients sharded; 3: + parameters sharded (FSDP full shard).",
    )
    micro_batch_size: int = Field(1, ge=1, le=MAX_BATCH, description="Sequences per micro-batch per data parallel replica.")
    recompute: Recompute = Field("none", description="Activation recomputation: none, selective (the attention core, or "
                                 "the modules in recompute_modules) or full (whole layer).")
    recompute_num_layers: int | None = Field(
        None, ge=1, le=MAX_LAYERS,
        description="With full recompute, how many layers per pipeline chunk are recomputed (Megatron's block "
        "method); None = all of them.",
    )
    recompute_modules: list[str] | None = Field(
        None,
        description="With selective recompute, the parts of each layer recomputed in backward (Megatron's "
        "--recompute-modules): core_attn, layernorm, mla_up_proj, mlp, moe_act, shared_experts, moe; "
        "None = core_attn only.",
    )
    offload_optimizer: bool = Field(False, description="Optimizer states and step on the CPU (ZeRO-Offload).")
    offload_activation_layers: int | None = Field(
        None, ge=1, le=MAX_LAYERS,
        description="Activation offloading to host memory (Megatron's --cpu-offloading --cpu-offloading-num-layers): "
        "the activations of this many transformer layers, the first ones, are copied to the host during the forward "
        "and back during the backward, beside the next layers' compute; needs pp 1 and no recomputation, and fewer "
        "layers than the model has. None = off.",
    )
    num_layers_in_first_stage: int | None = Field(
        None, ge=1, le=MAX_LAYERS, description="Layers on the first pipeline stage when the split is uneven; None = even split."
    )
    num_layers_in_last_stage: int | None = Field(
        None, ge=1, le=MAX_LAYERS, description="Layers on the last pipeline stage when the split is uneven; None = even split."
    )
    stage_layers: list[int] | None = Field(
        None,
        description="Explicit split: transformer layers on each pipeline stage, first to last (length pp; each a "
        "multiple of vpp, split evenly over the stage's vpp chunks), or on each virtual stage in schedule order "
        "(length pp·vpp, vpp > 1; virtual stage j runs on pipeline stage j mod pp; 0 allowed, as Megatron's "
        "--pipeline-model-parallel-layout allows an empty virtual stage, but every pipeline stage holds at least "
        "one layer); summing to num_layers. The embedding stays on the first stage, the output layer, loss and "
        "MTP layers on the last. None = even split or the first/last-stage fields.",
    )
    embedding_as_layer: bool = Field(
        False, description="Count the input embedding as one layer when splitting layers evenly over pipeline "
        "stages, so the first stage gets one transformer layer fewer (Megatron's account-for-embedding split).",
    )
    loss_as_layer: bool = Field(
        False, description="Count the output layer and loss as one layer when splitting layers evenly over "
        "pipeline stages, so the last stage gets one transformer layer fewer (Megatron's account-for-loss split).",
    )
    overlap_grad_reduce: bool = Field(True, description="Overlap the data parallel gradient reduction with backward.")
    overlap_param_gather: bool = Field(True, description="Overlap the ZeRO parameter all-gather with forward.")
    overlap_p2p_comm: bool = Field(
        True, description="Interleaved pipelines (vpp > 1): overlap the steady-state point-to-point activation "
        "transfers with the neighbouring chunks' compute (Megatron's --overlap-p2p-communication, on by default "
        "there and in Megatron-Bridge's interleaved recipes); off: every transfer blocks, as in the 2021-22 "
        "schedule. No effect with vpp 1 or on frameworks whose schedule does not overlap them.")
    rank_order: Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"] = Field(
        "tp-cp-ep-dp-pp", description="How ranks map onto the parallel dimensions, innermost first (RANK_ORDERS): "
        "which groups share an NVLink domain, a rack or a pod. tp-cp-ep-dp-pp is Megatron-core's default (and "
        "every other framework's); tp-cp-ep-pp-dp is Megatron's --use-tp-pp-dp-mapping (Megatron and "
        "Megatron-Bridge only).")
    overlap_moe_comm: bool = Field(
        False, description="MoE: overlap each micro-batch's token all-to-all with another micro-batch's compute "
        "(Megatron's --overlap-moe-expert-parallel-comm, which runs one micro-batch's forward beside another's "
        "backward); needs ep > 1, vpp > 1 when pp > 1, and no full recompute.")

    @model_validator(mode="after")
    def _check(self) -> "Strategy":
        if isinstance(self.dp, int) and not 1 <= self.dp <= MAX_GPUS:
            raise SpecError(f"dp ({self.dp}) must be 'auto' or an integer between 1 and {MAX_GPUS}")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("sequence_parallel requires tp > 1 (tp is 1)")
        if self.vpp > 1 and self.pp == 1:
            raise SpecError(f"vpp ({self.vpp}) > 1 requires pp > 1 (pp is 1)")
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise SpecError(f"recompute_num_layers ({self.recompute_num_layers}) needs recompute='full' (is {self.recompute!r})")
        if self.recompute_modules is not None:
            unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
            if unknown or not self.recompute_modules:
                raise SpecError(f"recompute_modules {self.recompute_modules} must be a non-empty list of "
                                f"{', '.join(RECOMPUTE_MODULES)}")
            if self.recompute != "selective":
                raise SpecError(f"recompute_modules needs recompute='selective' (is {self.recompute!r})")
        uneven = (self.num_layers_in_first_stage, self.num_layers_in_last_stage)
        if any(v is not None for v in uneven) and self.pp == 1:
            raise SpecError("num_layers_in_first_stage/last_stage need pp > 1 (pp is 1)")
        if self.stage_layers is not None:
            x, p, v = self.stage_layers, self.pp, self.vpp
            if v > 1 and len(x) == p * v:  # one count per virtual stage
                if any(not 0 <= n <= MAX_LAYERS for n in x) or any(sum(x[r::p]) < 1 for r in range(p)):
                    raise SpecError(f"stage_layers {x} with one count per virtual stage (pp·vpp = {p}·{v}) must list "
                                    f"layer counts >= 0 that give each of the pp ({p}) stages at least one layer")
            elif len(x) != p or any(not 1 <= n <= MAX_LAYERS for n in x):
                raise SpecError(f"stage_layers {x} must list a positive layer count for each of the pp ({p}) stages"
                                + (f", or a count >= 0 for each of the pp·vpp ({p * v}) virtual stages" if v > 1
                                   else ""))
            if any(v is not None for v in uneven) or self.embedding_as_layer or self.loss_as_layer:
                raise SpecError("stage_layers fixes every stage; it cannot be combined with num_layers_in_first_stage/"
                                "last_stage or embedding_as_layer/loss_as_layer")
        if (self.embedding_as_layer or self.loss_as_layer) and any(v is not None for v in uneven):
            raise SpecError("embedding_as_layer/loss_as_layer apply to an even split; they cannot be combined with "
                            "num_layers_in_first_stage/last_stage")
        if self.offload_activation_layers is not None and (self.pp > 1 or self.recompute != "none"):
            raise SpecError(f"offload_activation_layers ({self.offload_activation_layers}) needs pp 1 and recompute "
                            f"'none' (pp is {self.pp}, recompute {self.recompute!r}): Megatron offloads activations "
                            "without pipeline parallelism or recomputation only")
        if self.offload_optimizer and self.zero_stage == 0:
            raise SpecError("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload shards the optimizer)")
        return self

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one model replica: tp·cp·pp."""
        return self.tp * self.cp * self.pp

    @property
    def num_gpus(self) -> int:
        if self.dp == "auto":
            raise SpecError("dp is 'auto'; resolve the strategy for a GPU count first")
        return self.dp * self.model_parallel_size

    def resolve(self, num_gpus: int) -> "Strategy":
        """Fix dp='auto' from the GPU count; check the product of the degrees.

        The 16-GPU example of the module docstring (tp=2, pp=4) leaves dp=2:

        >>> Strategy(tp=2, pp=4).resolve(16).dp
        2
        >>> Strategy(dp=2, tp=2, pp=4).resolve(8)
        Traceback (most recent call last):
        planner.errors.SpecError: dp·tp·cp·pp (2·2·1·4 = 16) must equal the number of GPUs (8)
        """
        mp = self.model_parallel_size
        if self.dp == "auto":
            if num_gpus % mp:
                raise SpecError(f"tp·cp·pp ({mp}) must divide the number of GPUs ({num_gpus})")
            return self.model_copy(update={"dp": num_gpus // mp})
        if self.dp * mp != num_gpus:
            raise SpecError(f"dp·tp·cp·pp ({self.dp}·{self.tp}·{self.cp}·{self.pp} = {self.dp * mp}) must equal the number of GPUs ({num_gpus})")
        return self

    def num_microbatches(self, global_batch_size: int) -> int:
        """global_batch_size / (micro_batch_size · dp), at least 1 (the array form is
        `cost_models.layout.ParallelLayout.num_microbatches`); the caller checks divisibility."""
        if self.dp == "auto":
            raise SpecError("dp is 'auto'; resolve the strategy for a GPU count first")
        return max(global_batch_size // (self.micro_batch_size * self.dp), 1)

    def split_label(self) -> str:
        """The non-default parts of the stage split, e.g. `split=3,4,4,3` (the counts as
        `--stage-layers` takes them), `first=3 last=3`, `emb+loss-as-layer`; empty for an even split.

        >>> Strategy(pp=2, vpp=2, stage_layers=[4, 4, 4, 1]).split_label()
        'split=4,4,4,1'
        """
        if self.stage_layers is not None:
            return "split=" + ",".join(map(str, self.stage_layers))
        parts = []
        if self.num_layers_in_first_stage is not None:
            parts.append(f"first={self.num_layers_in_first_stage}")
        if self.num_layers_in_last_stage is not None:
            parts.append(f"last={self.num_layers_in_last_stage}")
        if self.embedding_as_layer or self.loss_as_layer:
            parts.append("+".join(n for n, on in (("emb", self.embedding_as_layer), ("loss", self.loss_as_layer)) if on)
                         + "-as-layer")
        return " ".join(parts)

    def short(self) -> str:
        """Compact label:

        >>> Strategy(dp=16, tp=8, pp=8, vpp=3, sequence_parallel=True, zero_stage=1, recompute="selective").short()
        'dp16 tp8 pp8 vpp3 sp z1 mbs1 rc=selective'
        """
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.sequence_parallel:
            parts.append("sp")
        rc = self.recompute + (f"({'+'.join(self.recompute_modules)})" if self.recompute_modules else "")
        parts += [f"z{self.zero_stage}", f"mbs{self.micro_batch_size}", f"rc={rc}"]
        if self.recompute_num_layers:
            parts.append(f"rcl{self.recompute_num_layers}")
        split = self.split_label()
        if split:
            parts.append(split)
        if self.offload_optimizer:
            parts.append("offload")
        if self.offload_activation_layers:
            parts.append(f"act-offload{self.offload_activation_layers}")
        if self.overlap_moe_comm:
            parts.append("a2a-overlap")
        if self.vpp > 1 and not self.overlap_p2p_comm:
            parts.append("p2p-blocking")
        if self.rank_order != RANK_ORDERS[0]:
            parts.append("order=" + self.rank_order)
        return " ".join(parts)
