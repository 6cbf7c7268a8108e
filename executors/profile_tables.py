"""`meshplan profile`'s attention, element-wise and memory tables (no torch).

Turns the worker's measurements (`executors.profile_worker`) into
kernels/attention/<name>.yaml, kernels/elementwise/<name>.yaml and
kernels/memory/<name>.yaml, `kind: measured`, in the formats the cost model reads
(`profiles.attention`, `profiles.elementwise`, `profiles.memory`). Every field has its `*_source` line: measured
by this run, derived from the device, or carried from a shipped table with the
reason it is not measured.

attention       achieved TFLOP/s of torch's scaled_dot_product_attention per
                (direction, causal, head dim) over the measured sequence lengths,
                FlashAttention's FLOP convention (causal halved, backward 2.5 x)
elementwise     hbm_fraction          large-copy rate / the GPU profile's hbm_bw_gb_per_s
                kernel_fixed_us       device time of one tiny element-wise kernel
                host_per_kernel_us    host time to issue one op with autograd recording
                optimizer_hbm_fraction  Adam step bytes (cost_models.units, fp32) / time / hbm_bw
                fp8_recipes, fp8_transpose  from the device's compute capability
                backward_kernels_per_forward, host_per_expert_*, moe_host_ops: carried
memory          cuda_context_mib      CUDA: device memory outside the allocator before NCCL;
                                      CPU: the rank's measured resident baseline
                nccl_connection_mib, nccl_channels: CUDA carried, CPU 0 (gloo)
                allocator_slack_fraction: carried

Carried fields come from the shipped set of the same GPU (`shipped_set`: the device name
torch reports), or from the H100 SXM set, the reference the other shipped sets derive from.
"""

from __future__ import annotations

from typing import Any

from cost_models.units import optimizer_step_traffic_bytes

MIB = 2**20
#: torch.cuda.get_device_name() fragments (lower case) -> shipped table set; the first match wins
#: ("NVIDIA H100 80GB HBM3" is the SXM5 part; PCIe and NVL parts match nothing; "gb300" before "b300", which
#: it contains, as "NVIDIA B300 SXM6 AC" names the HGX part).
SHIPPED_SETS = (("gb300", "gb300"), ("gb200", "gb200"), ("b300", "b300"), ("b200", "b200"), ("h200", "h200"),
                ("h100 80gb hbm3", "h100-sxm"), ("h100 sxm", "h100-sxm"))
REFERENCE_SET = "h100-sxm"
FLOP_CONVENTION = ("FlashAttention benchmark convention (benchmarks/benchmark_flash_attention.py, flops()): forward "
                   "FLOP = 4 * batch * seq_len^2 * heads * head_dim, halved with the causal mask; backward FLOP = 2.5 x "
                   "the forward FLOP of the same call")
#: Bytes per parameter of the measured Adam step: fp32 weights and gradients (read the gradient, read and
#: write the weight and both moments), as the cost model counts optimizer traffic.
ADAM_FP32_BYTES = optimizer_step_traffic_bytes("adam", "fp32", "fp32")


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measured_on(raw: dict[str, Any]) -> str:
    return f"measured by `meshplan profile` on {raw['description']}, {raw['started_utc'][:10]}"


def shipped_set(description: str) -> str | None:
    """The shipped table set of the GPU torch names `description`, or None (a CPU, an unlisted GPU)."""
    low = description.lower()
    return next((s for fragment, s in SHIPPED_SETS if fragment in low), None)


def carried_table(topic: str, description: str) -> tuple[dict[str, Any], str, str]:
    """(table, file, why that file) of the shipped `topic` table carried for this device: its own
    GPU's set when shipped, else the reference set; a `same_as` file is followed to its table."""
    from profiles import PROFILES_DIR, read_yaml

    name = shipped_set(description)
    why = (f"the shipped set of this GPU ({name})" if name else
           f"no shipped set for {description}; the {REFERENCE_SET} reference set")
    name = name or REFERENCE_SET
    data = read_yaml(PROFILES_DIR / "kernels" / topic / f"{name}.yaml", f"{topic} kernel table")
    if data.get("same_as"):
        name = str(data["same_as"])
        data = read_yaml(PROFILES_DIR / "kernels" / topic / f"{name}.yaml", f"{topic} kernel table")
    return data, f"profiles/kernels/{topic}/{name}.yaml", why


def _header(raw: dict[str, Any], source: str, carried_from: str | None = None) -> dict[str, Any]:
    head = {"kind": "measured", "gpu": raw["description"], "source": source}
    return head | ({"carried_from": carried_from} if carried_from else {})


# ---- attention -------------------------------------------------------------
def attention_table_profile(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The measured attention table: one curve per (direction, causal, head dim) measured at every
    sequence length of the grid. None when the forward with and without the mask or the unmasked
    backward is missing (the loader needs them; it derives the causal backward if absent). A profile
    that measured FlashAttention-2 too (`attention_flash2`, CUDA) adds it as the table's `flash2:`
    section (attention_kernel flash2), when that measurement is complete."""
    table = _attention_body(raw, raw["attention"], source)
    if table is None:
        return None
    flash2 = raw.get("attention_flash2")
    body = _attention_body(raw, flash2, source) if flash2 else None
    if body is not None:
        table["flash2"] = {k: v for k, v in body.items() if k not in ("kind", "gpu")}
    return table


def _attention_body(raw: dict[str, Any], att: dict[str, Any], source: str) -> dict[str, Any] | None:
    seq_lens = list(att["seq_lens"])
    rate = {(r["direction"], r["causal"], r["head_dim"], r["seq_len"]): r["flop_per_s"] for r in att["rows"]}
    curves = []
    for direction in ("fwd", "bwd"):
        for causal in (False, True):
            for d in att["head_dims"]:
                if all((direction, causal, d, s) in rate for s in seq_lens):
                    curves.append({"direction": direction, "causal": causal, "head_dim": int(d),
                                   "tflops": [_sig(rate[(direction, causal, d, s)] / 1e12) for s in seq_lens],
                                   "source": f"{measured_on(raw)}: {direction}, "
                                             f"{'causal' if causal else 'no mask'}, head dim {d}"})
    have = {(c["direction"], c["causal"]) for c in curves}
    if len(seq_lens) < 2 or not {("fwd", False), ("fwd", True), ("bwd", False)} <= have:
        return None
    return _header(raw, source) | {
        "kernel": f"{att['kernel']}, {att['dtype']}, torch {raw['torch_version']}",
        "flop_convention": FLOP_CONVENTION,
        "measured_at": f"{att['tokens']} tokens per call (batch = tokens / seq_len), hidden {att['hidden']} "
                       f"(heads = hidden / head_dim); the backward timed alone (autograd.grad of a kept forward graph)",
        "seq_lens": [int(s) for s in seq_lens], "curves": curves}


# ---- element-wise ----------------------------------------------------------
def fp8_support(capability: list[int] | None) -> tuple[list[str], bool, str]:
    """(recipes, transpose, source) from the compute capability (None: a CPU), by Transformer Engine's
    rules: FP8 GEMMs need sm_89+, block scaling (blockwise) sm_90+, MXFP8 sm_100+; before Blackwell the
    FP8 tensor-core GEMMs take only the TN layout, so quantised inputs get a transposed copy."""
    rule = ("Transformer Engine: FP8 needs sm_89 or later, 1x128/128x128 block scaling sm_90, MXFP8 sm_100 "
            "(check_fp8_support, check_fp8_block_scaling_support, check_mxfp8_support); FP8 GEMMs before sm_100 "
            "take only the TN layout (transposed copies), Blackwell's also NN and NT")
    if capability is None:
        return [], False, "a CPU runs no FP8 recipe (Transformer Engine's FP8 needs an NVIDIA GPU, sm_89 or later)"
    cc = tuple(capability)
    recipes = [r for r, need in (("delayed", (8, 9)), ("tensorwise", (8, 9)), ("blockwise", (9, 0)),
                                 ("mxfp8", (10, 0))) if cc >= need]
    return recipes, bool(recipes) and cc < (10, 0), f"from the device's compute capability sm_{cc[0]}{cc[1]}: {rule}"


def elementwise_table_profile(raw: dict[str, Any], hbm_bw_bytes_per_s: float, source: str) -> dict[str, Any]:
    """The measured element-wise table; `hbm_bw_bytes_per_s` is the GPU profile's peak HBM bandwidth
    (hbm_bw_gb_per_s of the profile written beside it), the base the fractions are taken against."""
    on = measured_on(raw)
    copy, small = raw["memory"]["bytes_per_s"], raw["small_kernel"]
    opt = raw["optimizer"]
    opt_rate = opt["params"] * ADAM_FP32_BYTES / opt["time_s"]
    carried, carried_file, why = carried_table("elementwise", raw["description"])
    recipes, transpose, fp8_source = fp8_support(raw.get("capability"))
    base = (f"/ the GPU profile's hbm_bw_gb_per_s ({hbm_bw_bytes_per_s / 1e9:.4g} GB/s, which `meshplan profile` "
            f"sets to the measured copy rate), at most 1")
    carry = f"carried from {carried_file} ({why}): not measured by `meshplan profile`"
    return _header(raw, source, carried_file) | {
        "hbm_fraction": _sig(min(1.0, copy / hbm_bw_bytes_per_s)),
        "hbm_fraction_source": f"{on}: copy of {raw['memory']['bytes'] / MIB:.0f} MiB, "
                               f"{copy / 1e9:.4g} GB/s (read + write, all ranks at once) {base}",
        "kernel_fixed_us": _sig(small["time_per_kernel_s"] * 1e6),
        "kernel_fixed_source": f"{on}: {small['method']}, time per kernel",
        "host_per_kernel_us": _sig(raw["op_overhead"]["time_per_op_s"] * 1e6),
        "host_per_kernel_source": f"{on}: a chain of 200 16-element multiplies whose input requires grad "
                                  f"(dispatch, allocation, autograd recording, launch), wall clock per op",
        "host_per_expert_forward_us": carried["host_per_expert_forward_us"],
        "host_per_expert_backward_us": carried["host_per_expert_backward_us"],
        "host_per_expert_source": f"{carry} (host set-up per local expert of Transformer Engine's grouped MLP, "
                                  f"which the profile does not run)",
        "host_per_expert_gemm_us": carried["host_per_expert_gemm_us"],
        "host_per_expert_gemm_source": f"{carry} (host time of one per-expert GEMM call of Transformer Engine's "
                                       f"grouped linear, which the profile does not run)",
        "moe_host_ops": carried["moe_host_ops"],
        "moe_host_ops_source": f"{carry} (operations Megatron-core's MoE router and token dispatcher issue, "
                               f"counted by benchmarks/host_ops.py: a property of the code, not of the GPU)",
        "backward_kernels_per_forward": carried["backward_kernels_per_forward"],
        "backward_kernels_per_forward_source": f"{carry} (backward kernels per forward kernel are a property "
                                               f"of the framework's autograd graph, not of a micro-benchmark)",
        "optimizer_hbm_fraction": _sig(min(1.0, opt_rate / hbm_bw_bytes_per_s)),
        "optimizer_hbm_fraction_source": f"{on}: one {opt['implementation']} step over {opt['tensors']} "
                                         f"{opt['dtype']} tensors, {opt['params']} parameters x {ADAM_FP32_BYTES} B "
                                         f"(cost_models.units.optimizer_step_traffic_bytes, fp32) / "
                                         f"{opt['time_s'] * 1e3:.4g} ms = {opt_rate / 1e9:.4g} GB/s {base}",
        "fp8_recipes": recipes,
        "fp8_recipes_source": fp8_source,
        "fp8_transpose": transpose,
        "fp8_transpose_source": fp8_source,
    }


# ---- memory ----------------------------------------------------------------
def memory_table_profile(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The measured memory table: the context measured, NCCL's figures and the allocator slack carried
    on CUDA; on a CPU (gloo) the rank's resident baseline in place of the context and no NCCL buffers."""
    on = measured_on(raw)
    carried, carried_file, why = carried_table("memory", raw["description"])
    carry = f"carried from {carried_file} ({why}): not measured by `meshplan profile`"
    if raw["device"] == "cuda":
        context, context_source = raw["cuda_context_bytes"], (
            f"{on}: device total - free - PyTorch's reserved memory (torch.cuda.mem_get_info) once the GEMM, "
            f"attention and element-wise kernels are loaded, before the process group starts NCCL; the largest "
            f"rank; assumes no other process on the device")
        nccl = {"nccl_connection_mib": carried["nccl_connection_mib"],
                "nccl_connection_source": f"{carry} (NCCL allocates its buffers itself, per connection and channel)",
                "nccl_channels": carried["nccl_channels"],
                "nccl_channels_source": f"{carry} (NCCL picks its channel count per topology at run time)"}
    else:
        context, context_source = raw["runtime_baseline_bytes"], (
            f"{on}: a CPU run has no CUDA context; this is the memory the rank holds before the model (resident "
            f"anonymous memory after torch and gloo initialise, the GPU profile's framework_reserve_gib, which a "
            f"memory table replaces), the largest rank")
        nccl = {"nccl_connection_mib": 0, "nccl_connection_source": "a CPU run (gloo) opens no NCCL connections",
                "nccl_channels": 0, "nccl_channels_source": "a CPU run (gloo) opens no NCCL channels"}
    slack_note = "" if raw["device"] == "cuda" else "; a figure for PyTorch's CUDA caching allocator, kept as an estimate"
    return _header(raw, source, carried_file) | {
        "cuda_context_mib": _sig(context / MIB),
        "cuda_context_source": context_source,
        **nccl,
        "allocator_slack_fraction": carried["allocator_slack_fraction"],
        "allocator_slack_fraction_source": f"{carry} (needs the reserved / allocated peak of a training run)"
                                           f"{slack_note}",
    }
