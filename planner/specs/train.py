"""TrainSpec: what one optimizer step is (batch, sequence, precision, optimizer)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from planner.errors import SpecError
from planner.specs.base import MAX_BATCH, MAX_HEADS, MAX_TOKENS, Spec


#: The linear layers of a transformer layer LoRA can adapt, by their Hugging Face Llama module names (peft's
#: target_modules): attention's query, key, value and output projections; the MLP's gate, up and down projections.
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)


class TrainSpec(Spec):
    """Global batch, sequence length, precision and optimizer of the training run."""

    global_batch_size: int = Field(gt=0, le=MAX_BATCH, description="Sequences per optimizer step.")
    seq_len: int = Field(gt=0, le=MAX_TOKENS, description="Tokens per sequence.")
    precision: Literal["bf16", "fp16", "fp8", "nvfp4", "fp32"] = Field(
        "bf16",
        description="Compute precision of the GEMMs (fp8: FP8 GEMMs with bf16 weights and activations; "
        "nvfp4: Transformer Engine's NVFP4BlockScaling recipe on Blackwell, Megatron's --fp4-format e2m1 "
        "--fp4-recipe nvfp4: the linear layers' fprop, dgrad and wgrad GEMMs in FP4 E2M1 with E4M3 scales per "
        "16 elements and an FP32 scale per tensor, bf16 weights and activations kept; fp32: full precision, "
        "e.g. CPU runs).",
    )
    grad_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Precision of the gradient buffer that is reduced across data parallel ranks "
        "(fp32 = Megatron's main grads; fp16 = the ZeRO paper's accounting).",
    )
    optimizer: Literal["adam", "sgd"] = Field(
        "adam", description="adam: fp32 master weights + two fp32 moments; sgd: fp32 master weights + one moment."
    )
    attention_kernel: Literal["flash", "flash2", "flash1", "unfused"] = Field(
        "flash",
        description="flash: a fused kernel, scores never stored, timed as the GPU's fastest measured one (cuDNN on "
        "Hopper and Blackwell, as Transformer Engine picks); flash2: FlashAttention-2 (PyTorch SDPA's default "
        "on Hopper before torch 2.11, flash-attn 2), slower on Hopper; flash1: FlashAttention v1 (flash-attn 1.x, "
        "and the Triton FlashAttention kernels of its era such as LLM Foundry's attn_impl 'triton'), slower still; unfused: the a·s² score, softmax and "
        "dropout tensors are stored (Megatron 2021-22, Korthikanti et al.).",
    )

    zero3_impl: Literal["fsdp2", "deepspeed"] = Field(
        "fsdp2",
        description="Which ZeRO-3 implementation runs the zero_stage=3 plans: fsdp2 (PyTorch FSDP2, torchtitan) "
        "or deepspeed (DeepSpeed ZeRO-3, slower across nodes as measured; profiles/frameworks/zero3.yaml).",
    )

    framework: Literal["megatron", "torchtitan", "deepspeed", "colossalai"] = Field(
        "megatron",
        description="Framework the plan runs on: its per-micro-batch gradient reductions, its selective "
        "recompute policy and the strategies it can run are costed as it does them (profiles/frameworks/); "
        "torchtitan and deepspeed cost zero_stage 3 with their own ZeRO-3 and set zero3_impl to it (a zero3_impl "
        "given that contradicts it is refused); zero3_impl applies to the others.",
    )

    cross_entropy_fusion: bool = Field(
        True,
        description="Fused vocabulary-parallel cross-entropy (Megatron's --cross-entropy-loss-fusion; NeMo and "
        "Megatron-Bridge recipes turn it on, Megatron-LM's own default is off): fewer fp32 passes over the logits.",
    )
    cross_entropy_fusion_impl: Literal["native", "te"] = Field(
        "native",
        description="Which fused cross-entropy runs with cross_entropy_fusion under framework megatron (Megatron's "
        "--cross-entropy-fusion-impl; megatron-core's default native): native, Megatron's fused vocabulary-parallel "
        "kernel over fp32 copies of the logits; te, Transformer Engine's Triton parallel cross-entropy, which reads the "
        "16-bit logits and writes their gradient over them in place (what Megatron-Bridge's performance recipes run).",
    )
    torch_compile: bool = Field(
        True,
        description="torch.compile of a PyTorch-native model (framework torchtitan, its [compile] section): true costs "
        "element-wise, norm and rotary work as fused kernels (what Inductor, and Megatron's and Transformer Engine's "
        "own fused kernels, run); false costs them as torchtitan's eager PyTorch operators (RMSNorm decomposed in "
        "fp32, complex-number rotary, SiLU and the gate product apart, the attention output copied back to "
        "token-major). False is refused for other frameworks, whose element-wise kernels are their own.",
    )
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = Field(
        "delayed",
        description="FP8 scaling with precision fp8 (Megatron's --fp8-recipe, Transformer Engine): delayed or "
        "tensorwise (current) per-tensor scales, blockwise 1x128/128x128 tiles, mxfp8 1x32 blocks (Blackwell only).",
    )
    moe_dispatcher: Literal["alltoall", "deepep", "hybridep"] = Field(
        "alltoall",
        description="MoE token dispatcher (Megatron's --moe-token-dispatcher-type, --moe-flex-dispatcher-backend): "
        "alltoall sends a token once per routed expert (NCCL all-to-all); deepep and hybridep (the flex dispatcher) "
        "send it once per destination GPU, and across nodes once per destination node, forwarding inside the node "
        "over NVLink (cost_models.dispatch).",
    )
    moe_flex_num_sms: int | None = Field(
        None, ge=1, le=1024,
        description="SMs the flex dispatcher's kernels run on (Megatron's --moe-deepep-num-sms or "
        "--moe-hybridep-num-sms, whichever moe_dispatcher names); None: megatron-core's default (DeepEP 20, "
        "HybridEP 16). The measured dispatch rates are read at this count (cost_models.dispatch). Megatron-Bridge's "
        "performance recipes run HybridEP on 32.",
    )
    moe_router_padding_for_quantization: bool = Field(
        False,
        description="With precision fp8 under Megatron: the router pads each expert's token count to the FP8 "
        "alignment (16, MXFP8 32) in its routing map (Megatron's --moe-router-padding-for-quantization, formerly "
        "--moe-router-padding-for-fp8). Without it, megatron-core's grouped MLP pads the routed tokens to that "
        "alignment and unpads the experts' output with a copy of each (Transformer Engine's Fp8Padding and "
        "Fp8Unpadding); the cost model charges those copies.",
    )
    fp8_param_gather: bool = Field(
        False,
        description="With precision fp8: keep the weights of the FP8 GEMMs in FP8 only (no bf16 copy; the fp32 "
        "master weights stay in the optimizer) and all-gather them in FP8 under ZeRO (Megatron's --fp8-param-gather, "
        "which Megatron-Bridge's FP8 recipes set; it needs zero_stage >= 1, the distributed optimizer or "
        "Megatron-FSDP). mxfp8 still all-gathers bf16 values (megatron-core requantises them on arrival).",
    )
    fp4_bf16_layers_start: int = Field(
        0, ge=0, le=MAX_TOKENS,
        description="With precision nvfp4: transformer layers at the start of the model kept in bf16 (Megatron's "
        "--first-last-layers-bf16 --num-layers-at-start-in-bf16). NVIDIA's NVFP4 pretraining recipe keeps a few "
        "first and last layers in bf16 (arXiv 2509.25149: about 15 % of the layers, most of them at the end).",
    )
    fp4_bf16_layers_end: int = Field(
        0, ge=0, le=MAX_TOKENS,
        description="With precision nvfp4: transformer layers at the end of the model kept in bf16 (Megatron's "
        "--num-layers-at-end-in-bf16).",
    )
    moe_load_imbalance: float | None = Field(
        None, ge=1, le=MAX_HEADS,
        description="MoE: tokens the busiest expert rank receives over the mean; None = the cluster profile's "
        "value. Aux-loss balanced routers run near 1.1; a skewed router or small batches more.",
    )

    cuda_graph_impl: Literal["none", "transformer_engine", "local"] = Field(
        "none",
        description="CUDA graphs (Megatron's --cuda-graph-impl): none; transformer_engine, Transformer Engine's "
        "make_graphed_callables over the scopes of cuda_graph_scope, per layer; local, megatron-core's own capture, "
        "per layer or (scope full_iteration) the whole forward and backward. A captured scope's kernels are "
        "launched by one graph launch, which takes their host time off the step where the host bounds it "
        "(cost_models.elementwise); its static buffers are held for the graph (the cuda_graph_buffers term).",
    )
    cuda_graph_scope: list[Literal["attn", "mlp", "moe_router", "moe_preprocess", "full_iteration"]] | None = Field(
        None,
        description="What cuda_graph_impl captures (Megatron's --cuda-graph-scope): attn (the attention sub-layer "
        "with its norm), mlp (a dense MLP sub-layer), moe_router (the pre-MLP norm and the router), moe_preprocess "
        "(with moe_router: the dispatcher's preprocessing before its host wait), full_iteration (local only); "
        "None or empty: the whole layer (which a dropless MoE layer's experts cannot be).",
    )

    finetune: Literal["none", "full", "lora", "qlora"] = Field(
        "none",
        description="What the run trains: none (pre-training) or full (full fine-tuning: every parameter trained, "
        "costed as pre-training is); lora (Hu et al. 2021: the base weights frozen in 16 bits, low-rank adapters "
        "trained beside the linear layers of lora_target_modules, peft's LoraConfig); qlora (Dettmers et al. 2023: "
        "the base model's linear layers frozen in 4 bits (bitsandbytes NF4, double quantisation), dequantised to "
        "bf16 for every GEMM, with LoRA adapters). Frozen weights hold no gradients and no optimizer states; the "
        "backward still computes the input gradients of every frozen layer above the lowest adapter "
        "(cost_models.finetune).",
    )
    model_code: Literal["framework", "transformers"] = Field(
        "framework",
        description="Whose code builds the layers: the framework's own (Megatron-core, torchtitan, Megatron-DeepSpeed, "
        "Colossal-AI) or Hugging Face Transformers' (AutoModelForCausalLM, what the Trainer, Axolotl and LLaMA-Factory "
        "run under DeepSpeed or FSDP2: data parallel, eager element-wise work, its layers' own saved tensors, "
        "cost_models.finetune.layer_activation_bytes). LoRA and QLoRA plans are transformers plans (set so).",
    )
    lora_rank: int = Field(16, ge=1, le=MAX_HEADS, description="LoRA: the adapters' rank r (peft's r).")
    lora_alpha: float | None = Field(
        None, gt=0, le=1e6, description="LoRA: the scaling numerator (peft's lora_alpha, the update scaled by "
        "alpha / r); None: twice the rank. It changes no cost; the emitted configs carry it.")
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="LoRA: dropout on the adapters' input (peft's lora_dropout). Above 0, peft applies it to each "
        "adapted module's input on its own, which stores a dropped copy and its mask per module (costed).",
    )
    lora_target_modules: list[LoraTarget] | None = Field(
        None,
        description="LoRA: which linear layers of each transformer layer get adapters, by their Hugging Face Llama "
        "names (q_proj, k_proj, v_proj, o_proj: attention; gate_proj, up_proj, down_proj: the MLP, gate_proj only "
        "in a gated MLP); None: all of them that the model has (peft's 'all-linear', which leaves the output "
        "layer out).",
    )
    lora_layers: list[int] | None = Field(
        None,
        description="LoRA: which transformer layers (0-based) get adapters (peft's layers_to_transform); None: "
        "every layer. The backward stops at the lowest of them.",
    )
    adapter_precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="LoRA: the adapters' weights, gradients and optimizer precision: fp32 (peft's default "
        "autocast_adapter_dtype, which keeps adapters in fp32 beside a 16-bit base; Adam keeps two fp32 moments, no "
        "separate master copy) or bf16 (adapters, gradients in bf16; the optimizer's moments in fp32, as the "
        "QLoRA paper and paged_adamw_32bit run).",
    )
    qlora_double_quant: bool = Field(
        True,
        description="QLoRA: double quantisation (bitsandbytes bnb_4bit_use_double_quant): the fp32 absmax of every "
        "64 weights quantised to 8 bits in blocks of 256 (0.127 bits a weight of constants instead of 0.5).",
    )
    qlora_saves_inputs: bool = Field(
        False,
        description="QLoRA: every 4-bit linear layer keeps its input for the backward, as bitsandbytes did before "
        "its pull request #1270 (merged July 2024; 'the bug that caused a lot of memory issues with QLoRA'). Current "
        "releases keep only the 4-bit weight; set this to cost a run on an older bitsandbytes.",
    )
    paged_optimizer: bool = Field(
        False,
        description="Paged optimizer states (bitsandbytes paged_adamw_32bit): the states live in unified memory and "
        "move to the host only when the GPU runs short. They are counted on the GPU (paging absorbs spikes, the "
        "plan must fit without it); emitted as the optimizer name.",
    )

    @model_validator(mode="after")
    def _check_fp8_param_gather(self) -> "TrainSpec":
        if self.fp8_param_gather and self.precision != "fp8":
            raise SpecError(f"fp8_param_gather needs precision 'fp8' (precision is {self.precision!r}): only "
                            "FP8 training has FP8 weights to keep and gather")
        return self

    @model_validator(mode="after")
    def _check_nvfp4_framework(self) -> "TrainSpec":
        if self.precision == "nvfp4" and self.framework != "megatron":
            raise SpecError(f"precision 'nvfp4' is costed as Transformer Engine's NVFP4BlockScaling under Megatron "
                            f"(--fp4-format e2m1 --fp4-recipe nvfp4); framework {self.framework!r} is not")
        return self

    @model_validator(mode="after")
    def _check_fp4_bf16_layers(self) -> "TrainSpec":
        if (self.fp4_bf16_layers_start or self.fp4_bf16_layers_end) and self.precision != "nvfp4":
            raise SpecError(f"fp4_bf16_layers_start / fp4_bf16_layers_end need precision 'nvfp4' (precision is "
                            f"{self.precision!r}): they keep layers of an NVFP4 run in bf16")
        return self

    @model_validator(mode="after")
    def _check_router_padding(self) -> "TrainSpec":
        if self.moe_router_padding_for_quantization:
            if self.framework != "megatron":
                raise SpecError(f"moe_router_padding_for_quantization is Megatron's --moe-router-padding-for-quantization; "
                                f"framework {self.framework!r} has no such router")
            if self.precision not in ("fp8", "nvfp4"):
                raise SpecError(f"moe_router_padding_for_quantization needs precision 'fp8' or 'nvfp4' (precision is "
                                f"{self.precision!r}): megatron-core pads for quantised GEMMs only and refuses it otherwise")
        return self

    @model_validator(mode="after")
    def _check_flex_sms(self) -> "TrainSpec":
        if self.moe_flex_num_sms is not None and self.moe_dispatcher == "alltoall":
            raise SpecError("moe_flex_num_sms sets the SMs of the flex dispatcher (moe_dispatcher deepep or hybridep); "
                            "the alltoall dispatcher runs NCCL's all-to-all, whose SMs Megatron does not set")
        return self

    @model_validator(mode="after")
    def _check_cross_entropy_impl(self) -> "TrainSpec":
        if self.cross_entropy_fusion_impl == "te":
            if self.framework != "megatron":
                raise SpecError(f"cross_entropy_fusion_impl 'te' is Megatron's --cross-entropy-fusion-impl te; framework "
                                f"{self.framework!r} does not run Transformer Engine's cross-entropy")
            if not self.cross_entropy_fusion:
                raise SpecError("cross_entropy_fusion_impl 'te' needs cross_entropy_fusion (Megatron runs the fused "
                                "implementation it names only with --cross-entropy-loss-fusion)")
        return self

    @model_validator(mode="after")
    def _check_cuda_graphs(self) -> "TrainSpec":
        scope = self.cuda_graph_scope or []
        if self.cuda_graph_impl == "none":
            if scope:
                raise SpecError(f"cuda_graph_scope {scope} needs cuda_graph_impl 'transformer_engine' or 'local' "
                                "(cuda_graph_impl is 'none')")
            return self
        if self.framework != "megatron":
            raise SpecError(f"cuda_graph_impl {self.cuda_graph_impl!r} is Megatron's --cuda-graph-impl; framework "
                            f"{self.framework!r} captures no CUDA graphs the plan can cost")
        if len(set(scope)) != len(scope):
            raise SpecError(f"cuda_graph_scope {scope} names a scope twice")
        if "full_iteration" in scope and (self.cuda_graph_impl != "local" or scope != ["full_iteration"]):
            raise SpecError(f"cuda_graph_scope {scope}: full_iteration stands alone, with cuda_graph_impl 'local' "
                            "(megatron-core's TransformerConfig refuses it otherwise)")
        if "moe_preprocess" in scope and "moe_router" not in scope:
            raise SpecError(f"cuda_graph_scope {scope}: moe_preprocess needs moe_router (megatron-core captures the "
                            "dispatcher's preprocessing with the router only)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _adapters_are_transformers(cls, data: Any) -> Any:
        """LoRA and QLoRA plans are the Hugging Face model with peft: their model_code is 'transformers' whatever
        was written (a plan file written with another keeps its meaning)."""
        if isinstance(data, dict) and data.get("finetune") in ("lora", "qlora"):
            data = {**data, "model_code": "transformers"}
        return data

    @model_validator(mode="after")
    def _check_finetune(self) -> "TrainSpec":
        lora_fields = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_layers",
                       "adapter_precision")
        qlora_fields = ("qlora_double_quant", "qlora_saves_inputs")
        fields = type(self).model_fields
        given = [f for f in lora_fields + qlora_fields
                 if f in self.model_fields_set and getattr(self, f) != fields[f].default]  # a written default is fine
        if self.finetune not in ("lora", "qlora"):
            lora_given = [f for f in given if f in lora_fields]
            if lora_given:
                raise SpecError(f"{lora_given[0]} needs finetune 'lora' or 'qlora' (finetune is {self.finetune!r}): "
                                "only adapters have a rank, targets or layers")
        quant_given = [f for f in given if f in qlora_fields]
        if quant_given and self.finetune != "qlora":
            raise SpecError(f"{quant_given[0]} needs finetune 'qlora' (finetune is {self.finetune!r}: only QLoRA's "
                            "base weights are 4-bit)")
        if self.finetune not in ("lora", "qlora"):
            return self
        if self.precision not in ("bf16", "fp16"):
            raise SpecError(f"finetune {self.finetune!r} needs precision bf16 or fp16 (precision is "
                            f"{self.precision!r}): "
                            "the frozen base and its adapters compute in 16 bits (bitsandbytes' compute dtype for "
                            "qlora)")
        targets = self.lora_target_modules
        if targets is not None:
            if not targets:
                raise SpecError("lora_target_modules is empty: name at least one linear layer (or leave it unset "
                                "for all)")
            if len(set(targets)) != len(targets):
                raise SpecError(f"lora_target_modules {targets} names a module twice")
        layers = self.lora_layers
        if layers is not None:
            if not layers:
                raise SpecError("lora_layers is empty: name at least one layer (or leave it unset for every layer)")
            if min(layers) < 0:
                raise SpecError(f"lora_layers {layers}: layer indices start at 0")
            if len(set(layers)) != len(layers):
                raise SpecError(f"lora_layers {layers} names a layer twice")
        return self

    @property
    def adapters(self) -> bool:
        """Whether the run trains LoRA adapters over a frozen base (finetune lora or qlora)."""
        return self.finetune in ("lora", "qlora")

    @property
    def transformers(self) -> bool:
        """Whether the layers are Hugging Face Transformers' (model_code transformers; adapters always are)."""
        return self.model_code == "transformers" or self.adapters

    @property
    def effective_lora_alpha(self) -> float:
        """lora_alpha, or twice the rank when unset."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len
