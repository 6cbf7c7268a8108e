"""GpuSpec and ClusterSpec: the hardware as data.

Units inside are SI: bytes, FLOP/s, bytes/s, seconds. Preset YAML files carry
vendor units (GiB, TFLOP/s, GB/s, µs) in their key names and are converted on
load by `profiles.load` (capacities binary, rates decimal, as vendors publish).
Efficiencies are calibration data (`profiles/calibration/`), never literals in
formulas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from planner.errors import SpecError, short_repr
from planner.specs.base import MAX_GPUS, MAX_HEADS, Spec
from planner.specs.topology import Fabric, FabricLevel, TopologySpec

Precision = Literal["bf16", "fp16", "fp8", "fp32", "tf32"]
#: A training precision whose GEMMs run at another peak's key: NVFP4 at the FP4 tensor-core peak.
PEAK_KEY = {"nvfp4": "fp4"}

# ---- physical ranges of the hardware numbers, SI units, (least, most), both allowed: far beyond any
# real device either way, narrow enough that every time and capacity computed from them stays finite
# (a kernel overhead of 1e78 us overflowed float64). Profile files state them in their own units. ----
#: Memory of one GPU or one server: 1 MiB to 1 PiB.
MEMORY_BYTES_RANGE = (float(2**20), float(2**50))
#: Dense peak of one GPU at one precision: 1 MFLOP/s to 1 EFLOP/s.
FLOP_PER_S_RANGE = (1e6, 1e18)
#: Any bandwidth (HBM, a link tier per GPU, the GPU-host link, host DRAM): 1 MB/s to 1 PB/s.
BW_BYTES_PER_S_RANGE = (1e6, 1e15)
#: A fixed cost per kernel or per message (kernel overhead, link latency): 0 to 1 s.
LATENCY_S_RANGE = (0.0, 1.0)
#: An achievable fraction of a peak rate (GEMM, HBM, link, host DRAM efficiencies), which the rate is multiplied
#: by and the time divided by: 0.1 % to 100 % (a fraction of 1e-300 made a 1e-300 link of a fast one).
EFFICIENCY_RANGE = (1e-3, 1.0)
#: host_time_scale, a slowdown of the host's issue times: 1 to 100.
HOST_TIME_SCALE_RANGE = (1.0, 100.0)
#: The largest relative step-time error a residual statistic may state (predicted / measured - 1): a prediction
#: 101 times the measured step, far beyond any calibrated GPU; the band it spans stays finite.
RELATIVE_ERROR_MAX = 100.0
#: The most end-to-end rows one band may rest on.
MAX_RESIDUAL_ROWS = 10**6
#: A GPU board's rated power: 1 W to 10 kW, watts.
BOARD_POWER_W_RANGE = (1.0, 1e4)
#: Bytes per GiB, the unit messages state memory in.
GIB = 2**30


class StepTimeResiduals(Spec):
    """How far the cost model's step times fell from published end-to-end runs on one GPU: the
    basis of every Estimate's error band (planner.error_band). Errors are signed relative errors
    of the step time, predicted / measured - 1 (< 0: the model predicts faster than measured).
    Written into `profiles/calibration/<gpu>.yaml` under `step_time_residuals:` by
    `python -m benchmarks.residuals --write`."""

    end_to_end: bool = Field(
        description="True: from this GPU's own published end-to-end runs that no fit used; False: no such run "
        "exists, and the band is another GPU set's widened by the rule `basis` states.")
    n: int = Field(ge=0, le=MAX_RESIDUAL_ROWS,
                   description="Rows the band rests on (on the reference GPUs when end_to_end is False).")
    tables: list[str] = Field(default_factory=list, description="The published sets the rows come from, "
                              "each with its row count.")
    error_low: float = Field(gt=-1, le=0, description="Signed relative step-time error at the band's fast edge "
                             "(<= 0): the measured step is at most predicted / (1 + error_low).")
    error_high: float = Field(ge=0, le=RELATIVE_ERROR_MAX, description="Signed relative step-time error at the band's slow edge (>= 0): "
                              "the measured step is at least predicted / (1 + error_high).")
    coverage: float | None = Field(
        None, gt=0, lt=1, description="Nominal share of new runs inside the band (order-statistic prediction "
        "interval of the rows); None where the band is widened by a rule rather than measured.")
    median_abs: float | None = Field(None, ge=0, le=RELATIVE_ERROR_MAX,
                                     description="Median |relative error| of the rows.")
    mean_signed: float | None = Field(None, gt=-1, le=RELATIVE_ERROR_MAX,
                                      description="Mean signed relative error of the rows (the bias).")
    max_abs: float | None = Field(None, ge=0, le=RELATIVE_ERROR_MAX,
                                  description="Largest |relative error| of the rows.")
    basis: str = Field(description="One line: which rows, or which rule, the band comes from.")
    dense: StepTimeResiduals | None = Field(
        None, description="The band of dense-model plans alone, from this GPU's own dense rows (present when "
        "there are enough of them, planner.error_band.MIN_KIND_ROWS); plans of dense models use it.")
    moe: StepTimeResiduals | None = Field(
        None, description="The band of mixture-of-experts plans alone, from this GPU's own MoE rows (present "
        "when there are enough of them); plans of MoE models use it.")


class GpuSpec(Spec):
    """One accelerator: capacity, peak rates and achievable fractions of them."""

    name: str = Field(description="GPU name, e.g. A100-SXM4-80GB.")
    memory_bytes: float = Field(ge=MEMORY_BYTES_RANGE[0], le=MEMORY_BYTES_RANGE[1],
                                description="HBM capacity in bytes (MEMORY_BYTES_RANGE).")
    peak_flop_per_s: dict[str, float] = Field(
        description="Dense peak FLOP/s per dtype (bf16, fp16, fp8, fp4, tf32, fp32); no sparsity; each in "
        "FLOP_PER_S_RANGE."
    )
    hbm_bw_bytes_per_s: float = Field(ge=BW_BYTES_PER_S_RANGE[0], le=BW_BYTES_PER_S_RANGE[1],
                                      description="Peak HBM bandwidth in bytes/s (BW_BYTES_PER_S_RANGE).")
    gemm_efficiency: float = Field(
        0.75, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Achievable fraction of dense peak for large, well-shaped GEMMs (calibrated)."
    )
    hbm_efficiency: float = Field(
        0.8, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Achievable fraction of HBM bandwidth for element-wise kernels (calibrated)."
    )
    backward_gemm_ratio: float = Field(
        2.0, gt=0, le=4,
        description="Time of a layer's backward GEMMs over its forward GEMMs. The FLOP ratio is 2 (input and "
        "weight gradients); measured kernels differ (fitted per GPU; 2.0 where nothing was fitted).",
    )
    kernel_overhead_s: float = Field(
        5e-6, ge=LATENCY_S_RANGE[0], le=LATENCY_S_RANGE[1],
        description="Fixed cost per kernel (launch and tail), seconds (calibrated; LATENCY_S_RANGE)."
    )
    framework_reserve_bytes: float = Field(
        0.0, ge=0, le=MEMORY_BYTES_RANGE[1], description="Per-GPU memory not available to the model: CUDA context, "
        "NCCL, allocator slack; less than memory_bytes."
    )
    grouped_gemm_efficiency: float = Field(
        1.0, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Throughput of a grouped GEMM (MoE experts in one kernel) relative to a dense GEMM of the same "
        "FLOPs, before the roofline's memory bound (which the per-expert shapes already give). Used only on a GPU "
        "without a GEMM kernel table; with one, each expert's GEMM is timed at its own shape (four at a time, "
        "Transformer Engine's streams).",
    )
    host_link_bw_bytes_per_s: float | None = Field(
        None, ge=BW_BYTES_PER_S_RANGE[0], le=BW_BYTES_PER_S_RANGE[1],
        description="GPU-host bandwidth per direction (PCIe or NVLink-C2C), bytes/s, as achieved by "
        "pinned copies (BW_BYTES_PER_S_RANGE); None: unknown (optimizer offload is then refused).",
    )
    sustained_compute_fraction: float = Field(
        1.0, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Share of its kernel tables' measured throughput a GPU sustains in training (power- and "
        "clock-limited, kernels back to back, beside communication kernels); fitted per GPU generation on the "
        "end-to-end rows its calibration file names. Applies only to the parts timed from kernel tables.",
    )
    host_time_scale: float = Field(
        1.0, ge=HOST_TIME_SCALE_RANGE[0], le=HOST_TIME_SCALE_RANGE[1], description="Factor on the host-time figures of the GPU's element-wise kernel table (the CPU's "
        "issue time per kernel, the grouped MLP's per-expert set-up and per-expert GEMM calls): 1 uses the table's "
        "figures; above 1 the host is that much slower in training than they say. Fitted for the x86 DGX hosts on "
        "the host-bound end-to-end rows their calibration file names (python -m benchmarks.generations). Only with "
        "kernel tables.",
    )
    kernel_tables: str | None = Field(
        None, description="Name of the kernel-table set under profiles/kernels/<topic>/ (see profiles.tables); "
        "None: no tables, every part uses the calibrated constants above.",
    )
    source: str = Field("", description="Datasheet or measurement the numbers come from.")
    calibration: str = Field("", description="Which data the efficiencies were fitted on, or 'assumed'.")
    board_power_w: float | None = Field(
        None, ge=BOARD_POWER_W_RANGE[0], le=BOARD_POWER_W_RANGE[1],
        description="The GPU board's rated power (maximum thermal design power), watts, as its vendor publishes it "
        "(BOARD_POWER_W_RANGE); the energy of a training run is estimated from it (planner.capacity). None: no "
        "published figure, and energy is refused for this GPU.")
    board_power_source: str = Field(
        "", description="Where board_power_w comes from (a datasheet), or why there is none.")
    step_time_residuals: StepTimeResiduals | None = Field(
        None, description="Step-time errors on published end-to-end runs (or the widened rule where none exist), "
        "from the GPU's calibration file; the basis of every estimate's error band. None: none known.")

    #: The profile tables the cost model reads for this GPU (`profiles.bundle.ProfileTables`), attached by
    #: `profiles.resolve_gpu`; not a field: no part of the JSON, the hash or equality.
    _tables: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal fields (the attached tables are derived from the profile roots, not part of the spec)."""
        if not isinstance(other, GpuSpec):
            return NotImplemented
        return type(self) is type(other) and all(getattr(self, f) == getattr(other, f) for f in type(self).model_fields)

    @property
    def has_tables(self) -> bool:
        """Whether tables resolved for this GPU's `kernel_tables` are attached."""
        return self._tables is not None and self._tables.kernel_set == self.kernel_tables

    @property
    def tables(self) -> Any:
        """The resolved profile tables (`profiles.bundle.ProfileTables`: the `kernel_tables` set's GEMM, attention,
        element-wise, collectives, memory and dispatch tables, and the framework profiles) the cost model reads.
        A GPU not resolved through `profiles` (or a copy with another `kernel_tables`) has none: SpecError."""
        if not self.has_tables:
            raise SpecError(f"GPU {self.name}: its profile tables (kernel_tables {self.kernel_tables!r}) are not "
                            "resolved; load it with profiles.load_gpu / load_cluster or resolve_gpu, or plan through "
                            "planner.plan / evaluate")
        return self._tables

    def with_tables(self, tables: Any) -> "GpuSpec":
        """A copy of this GPU carrying `tables` (see `tables`)."""
        out = self.model_copy()
        out._tables = tables
        return out

    @model_validator(mode="after")
    def _check(self) -> "GpuSpec":
        low, high = FLOP_PER_S_RANGE
        bad = {k: v for k, v in self.peak_flop_per_s.items() if not low <= v <= high}  # NaN fails too
        if not self.peak_flop_per_s or bad:
            raise SpecError(f"peak_flop_per_s must give a rate between {low:g} and {high:g} FLOP/s for each of at "
                            f"least one precision (got {short_repr(bad or self.peak_flop_per_s)})")
        if self.framework_reserve_bytes >= self.memory_bytes:
            raise SpecError(f"framework_reserve_bytes ({self.framework_reserve_bytes / GIB:g} GiB) must be less "
                            f"than the GPU's memory_bytes ({self.memory_bytes / GIB:g} GiB): the reserve is the "
                            "part of that memory the model cannot use")
        return self

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s for `precision` (nvfp4: the FP4 tensor-core peak, `fp4`); a clear error if the
        GPU has none."""
        try:
            return self.peak_flop_per_s[PEAK_KEY.get(precision, precision)]
        except KeyError:
            raise SpecError(
                f"GPU {self.name} has no peak rate for precision {precision!r}; "
                f"it has: {', '.join(sorted(self.peak_flop_per_s))}"
            ) from None


class LinkTier(Spec):
    """One tier of the network as seen by one GPU (alpha-beta model)."""

    name: str = Field(description="Tier name, e.g. nvlink or infiniband.")
    bw_bytes_per_s: float = Field(ge=BW_BYTES_PER_S_RANGE[0], le=BW_BYTES_PER_S_RANGE[1],
                                  description="Per-GPU unidirectional link bandwidth, bytes/s (BW_BYTES_PER_S_RANGE).")
    latency_s: float = Field(ge=LATENCY_S_RANGE[0], le=LATENCY_S_RANGE[1],
                             description="Per-message latency (alpha), seconds (LATENCY_S_RANGE).")
    efficiency: float = Field(
        0.8, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Achievable all-reduce bus bandwidth as a fraction of the link rate (NCCL busbw)."
    )
    gather_scatter_efficiency: float | None = Field(
        None, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Achievable all-gather / reduce-scatter bus bandwidth as a fraction of the link rate; "
        "default: the all-reduce efficiency (as NCCL gets; gloo on CPU gets less).",
    )

    @property
    def bus_bw_bytes_per_s(self) -> float:
        return self.bw_bytes_per_s * self.efficiency

    @property
    def gather_scatter_bw_bytes_per_s(self) -> float:
        return self.bw_bytes_per_s * (self.gather_scatter_efficiency or self.efficiency)


class HostSpec(Spec):
    """The CPU side of a server: what optimizer offload uses."""

    memory_bytes: float = Field(ge=MEMORY_BYTES_RANGE[0], le=MEMORY_BYTES_RANGE[1],
                                description="Host DRAM per server, bytes (MEMORY_BYTES_RANGE).")
    memory_bw_bytes_per_s: float = Field(ge=BW_BYTES_PER_S_RANGE[0], le=BW_BYTES_PER_S_RANGE[1],
                                         description="Peak host DRAM bandwidth per server (all sockets), bytes/s "
                                         "(BW_BYTES_PER_S_RANGE).")
    memory_efficiency: float = Field(
        0.6, ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1],
        description="Share of the peak DRAM bandwidth a vectorised CPU optimizer sustains."
    )
    gpus_per_host_link: int = Field(
        1, ge=1, le=MAX_GPUS, description="GPUs whose host copies share one uplink to the CPU (the GPUs behind one "
        "PCIe switch, as on DGX A100); each gets this share of its `host_link_bw_bytes_per_s` while all copy at once."
    )


class ClusterSpec(Spec):
    """Identical GPUs in servers of `gpus_per_node`, grouped in NVLink domains of `domain_size` GPUs (one
    server on DGX/HGX systems; 18 servers of 4 GPUs in a GB200 NVL72 rack) joined by a scale-out network.
    The two link tiers are chosen by domain, not by server: `intra_node` prices a group whose ranks all lie
    in one NVLink domain, `inter_node` one that spans domains (cost_models.comm)."""

    name: str = Field(description="Cluster preset name.")
    gpu: GpuSpec = Field(description="The GPU every rank runs on.")
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS, description="GPUs per server (torchrun --nproc-per-node): the "
                               "launch layout, the node-filling warning and the share of a server's host memory "
                               "and bandwidth each GPU gets; not the link tiers (nvlink_domain_size chooses those).")
    nvlink_domain_size: int | None = Field(
        None, gt=0, le=MAX_GPUS, description="GPUs sharing one NVLink/NVSwitch domain, which may span servers (72 "
        "on 18 servers for GB200 NVL72); default: gpus_per_node. A group within it uses intra_node, one across "
        "domains inter_node; tensor parallelism is searched up to it."
    )
    segment_nodes: int | None = Field(
        None, gt=0, le=MAX_GPUS, description="Servers a job fills in each NVLink domain before the next (Slurm's "
        "--segment on clusters scheduled by topology/block): the job's ranks r sit in domain r // (segment_nodes · "
        "gpus_per_node). None: the largest divisor of the job's servers up to a domain's servers (the whole job "
        "where it fits in one domain), as Megatron-Bridge's launcher sets --segment on 4-GPU-server systems; "
        "whole domains where only 1 divides. Only a domain of several servers has segments."
    )
    intra_node: LinkTier = Field(description="The tier of a group (or a point-to-point transfer) whose ranks all "
                                 "lie in one NVLink domain of nvlink_domain_size GPUs: NVLink, whether the domain "
                                 "is one server or a rack of several (the name is historical: the tier is bounded "
                                 "by the domain, not by the node).")
    inter_node: LinkTier = Field(description="The scale-out tier (per GPU, one NIC per GPU) of a group that spans "
                                 "NVLink domains: between servers on DGX/HGX systems, between racks on NVL72, whose "
                                 "servers inside one rack talk over intra_node.")
    max_gpus: int | None = Field(None, gt=0, le=MAX_GPUS, description="Largest GPU count this cluster has, if bounded.")
    comm_overlap: float = Field(
        1.0, ge=0, le=1,
        description="Fraction of the communication a schedule overlaps with compute that really runs concurrently: "
        "1 where NICs and copy engines move the data (GPUs), near 0 where the computing cores also move it "
        "(gloo on CPU). Measured by `meshplan profile`.",
    )
    comm_compute_slowdown: float = Field(
        0.0, ge=0, le=1,
        description="How much slower compute runs while collective kernels share the SMs with it: the compute "
        "beside overlapped communication takes (1 + this) times as long, so overlapped communication costs "
        "this share of its hidden time after all. 0 where `comm_overlap` was measured with the contention in it.",
    )
    tp_comm_overlap: float = Field(
        0.0, ge=0, le=1,
        description="Share of the tensor-parallel all-gathers and reduce-scatters (sequence parallel, tp > 1) the "
        "training framework pipelines with the GEMMs beside them (Transformer Engine userbuffers, Megatron's "
        "--tp-comm-overlap, which the Megatron emitter then sets); 0: TP communication is on the critical path.",
    )
    ep_comm_overlap: float | None = Field(
        None, ge=0, le=1,
        description="Share of the MoE token exchange (dispatch and combine, both directions) that Megatron's "
        "--overlap-moe-expert-parallel-comm hides behind the other micro-batch's compute, contention and the "
        "schedule's own dependencies included (measured end to end); None: `overlap_efficiency`, as for any "
        "overlapped communication.",
    )
    moe_load_imbalance: float = Field(
        1.0, ge=1, le=MAX_HEADS,
        description="MoE: tokens the busiest expert rank receives over the mean (1 = perfect balance); the "
        "all-to-all and the experts wait for the busiest rank. A training run's own value overrides it.",
    )
    host: HostSpec | None = Field(None, description="The servers' CPU and DRAM (optimizer offload); None: unknown.")
    topology: TopologySpec | None = Field(None, description="How the cluster's topology graph is built "
                                          "(planner.specs.topology); None: the two tiers alone.")
    fabric: Fabric | None = Field(None, description="The per-level figures derived from the topology graph by "
                                  "profiles.topology (set when the cluster is loaded); None: one level, the NVLink "
                                  "domain, whose egress is the inter_node tier (the two-tier model).")
    source: str = Field("", description="Datasheets the numbers come from.")

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        domain = self.domain_size
        if domain % self.gpus_per_node and self.gpus_per_node % domain:
            raise SpecError(
                f"nvlink_domain_size ({domain}) and gpus_per_node ({self.gpus_per_node}) must divide one another"
            )
        if self.segment_nodes is not None and self.segment_nodes * self.gpus_per_node > domain:
            raise SpecError(f"segment_nodes ({self.segment_nodes}) of {self.gpus_per_node}-GPU servers must fit one "
                            f"NVLink domain ({domain} GPUs)")
        if self.fabric is not None and self.fabric.levels[0].unit_gpus != domain:
            raise SpecError(f"fabric level 0 ({self.fabric.levels[0].name}) holds {self.fabric.levels[0].unit_gpus} "
                            f"GPUs but the NVLink domain has {domain}: they are the same unit")
        return self

    @property
    def levels(self) -> list[FabricLevel]:
        """The fabric's levels, innermost first (`fabric`), or the two-tier model's one level: the NVLink
        domain, left at the inter_node tier's link rate and latency."""
        if self.fabric is not None:
            return list(self.fabric.levels)
        return [FabricLevel(name="nvlink-domain", unit_gpus=self.domain_size,
                            egress_bytes_per_s=self.inter_node.bw_bytes_per_s, latency_s=self.inter_node.latency_s)]

    @property
    def domain_size(self) -> int:
        return self.nvlink_domain_size or self.gpus_per_node

    def job_domain_gpus(self, num_gpus: int) -> int:
        """GPUs of a job of `num_gpus` in each NVLink domain it uses: ranks r sit in domain r // this
        (`segment_nodes`; by default the largest divisor of the job's servers up to a domain's servers, the
        rule Megatron-Bridge's launcher uses for Slurm's --segment; whole domains where only 1 divides).

        GB200 NVL72 (18 servers of 4 GPUs): 256 GPUs fill 64 per rack, 576 GPUs 72, 48 GPUs one rack:

        >>> from profiles import load_cluster
        >>> c = load_cluster("gb200-nvl72")
        >>> c.job_domain_gpus(256), c.job_domain_gpus(576), c.job_domain_gpus(48), c.job_domain_gpus(76)
        (64, 72, 48, 72)
        """
        domain, node = self.domain_size, self.gpus_per_node
        servers = domain // node
        if servers <= 1:
            return domain
        if self.segment_nodes is not None:
            return self.segment_nodes * node
        job = -(-int(num_gpus) // node)
        if job <= servers:
            return job * node
        best = max(s for s in range(1, servers + 1) if job % s == 0)
        return best * node if best > 1 else domain

    def job_units(self, num_gpus: int) -> list[int]:
        """GPUs of a job of `num_gpus` in one unit of each level (`levels`, innermost first): a unit holds
        `job_domain_gpus` of each of its NVLink domains, and the job's rank r sits in unit r // this.

        >>> from profiles import load_cluster
        >>> load_cluster("gb200-nvl72").job_units(512), load_cluster("gb200-nvl72").job_units(576)
        ([64, 512], [72, 576])
        """
        filled = self.job_domain_gpus(num_gpus)
        return [lv.unit_gpus * filled // self.domain_size for lv in self.levels]

    @property
    def overlap_efficiency(self) -> float:
        """Share of the communication a schedule overlaps that costs no step time:
        comm_overlap / (1 + comm_compute_slowdown). With hidden time h beside compute W ≥ h
        slowed by σ, the step takes W + h·σ/(1+σ): h/(1+σ) of h is really hidden."""
        return self.comm_overlap / (1.0 + self.comm_compute_slowdown)

    @property
    def ep_overlap_efficiency(self) -> float:
        """Share of the MoE exchange that --overlap-moe-expert-parallel-comm hides: `ep_comm_overlap` where
        the profile measured it, else `overlap_efficiency`."""
        return self.overlap_efficiency if self.ep_comm_overlap is None else self.ep_comm_overlap
