"""Goodput: the share of wall time a large training job trains, given failures and checkpoints.

A job of N GPUs fails at rate lambda·N (lambda per GPU-hour, failures independent), so its mean time between
failures is M = 1 / (lambda·N). It writes a checkpoint of the model state every tau seconds of compute, which
takes delta seconds; after a failure it restarts (R seconds: relaunch, reload the checkpoint) and redoes the work
since the last checkpoint. Daly's model of that cycle under exponential failures gives the expected wall time to
do T seconds of work (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), eq. 13 / 20):

    T_wall(tau) = M · exp(R / M) · (exp((tau + delta) / M) - 1) · T / tau

and its optimum interval (Daly 2006, eq. 37), which reduces to Young's first-order sqrt(2·delta·M) (Young 1974,
"A first order approximation to the optimum checkpoint interval", CACM 17(9)) when delta << M:

    tau_opt = sqrt(2·delta·M) · (1 + sqrt(delta / (2M)) / 3 + (delta / (2M)) / 9) - delta   for delta < 2M
    tau_opt = M                                                                            otherwise

Goodput is T / T_wall(tau_opt). Symbols: lambda = failure_rate_per_gpu_hour, N = num_gpus, M = mtbf_s,
delta = checkpoint_s, R = restart_s, tau = interval_s.

Assumptions: failures are independent and memoryless (the published rates are averages over weeks); a
checkpoint stops training while it is written (asynchronous checkpointing hides part of delta: this
over-counts it); the checkpoint is read back at its write bandwidth; intervals are not rounded to whole steps.
"""

from __future__ import annotations

import math

from cost_models.finetune import adapter_params, adapter_state_bytes
from cost_models.params import num_params
from cost_models.units import WEIGHT_BYTES, optimizer_state_bytes
from planner.errors import SpecError, short_repr
from planner.specs import ClusterSpec, ModelSpec, TrainSpec
from planner.specs.capacity import Goodput

# ---- failure rate: Llama 3 405B pre-training (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
# arXiv 2407.21783, Sec. 3.3.4 and Table 5): 466 job interruptions in a 54-day snapshot on 16,384 H100
# GPUs, 47 planned (maintenance) and 419 unexpected. The unexpected ones are failures:
#     419 / (54 d x 24 h/d x 16,384 GPUs) = 419 / 21,233,664 GPU-hours = 1.973e-5 per GPU-hour,
# i.e. a mean time between failures of 1 / 1.973e-5 = 50,677 hours per GPU, and about 3.1 hours for the
# 16,384-GPU job (the paper: "an interruption roughly every three hours").
#: Unexpected interruptions of the Llama 3 405B run in the snapshot (arXiv 2407.21783, Sec. 3.3.4).
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
#: Length of that snapshot, days.
LLAMA3_SNAPSHOT_DAYS = 54
#: GPUs of that run.
LLAMA3_NUM_GPUS = 16_384
#: Default failure rate per GPU-hour: the Llama 3 405B run's unexpected interruptions (above).
DEFAULT_FAILURE_RATE_PER_GPU_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_SNAPSHOT_DAYS * 24 * LLAMA3_NUM_GPUS)

#: ASSUMED checkpoint write bandwidth per node, bytes/s: 5 GB/s, about one 100 Gb/s storage NIC's worth sustained
#: into a parallel file system or object store per 8-GPU node. Not from a publication; set
#: node_write_bw_bytes_per_s, or cap the total with aggregate_write_bw_bytes_per_s (--ckpt-bandwidth), for yours.
DEFAULT_NODE_WRITE_BW_BYTES_PER_S = 5e9
#: ASSUMED restart time after a failure, seconds: 10 minutes to detect the failure, reschedule the job around the
#: bad node, start the ranks and build the communicators, before the checkpoint is read back. Not from a
#: publication; set restart_s for your cluster.
DEFAULT_RESTART_S = 600.0

#: Seconds per hour.
HOUR_S = 3600.0


def checkpoint_bytes(model: ModelSpec, train: TrainSpec) -> float:
    """Bytes of model state a checkpoint saves to resume training: every parameter's compute copy (16-bit, or
    32-bit in fp32 training: cost_models.units.WEIGHT_BYTES) and its optimizer state (fp32 master and moments:
    cost_models.units.optimizer_state_bytes). Mixed-precision Adam: 2 + 12 = 14 bytes per parameter; the
    parameter count is the cost model's (cost_models.params.num_params). With LoRA / QLoRA adapters
    (train.adapters) only the adapters are saved, each with its weight and optimizer moments
    (cost_models.finetune.adapter_state_bytes): the frozen base is the checkpoint the run started from. Data-loader
    and RNG state are small and left out."""
    if train.adapters:
        states = adapter_state_bytes(train)
        return float(adapter_params(model, train)) * (states.weight + states.optimizer)
    per_param = WEIGHT_BYTES[train.precision] + optimizer_state_bytes(train.optimizer, train.precision)
    return float(num_params(model)) * per_param


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young 1974's first-order optimum checkpoint interval sqrt(2·delta·M), seconds: the minimum of the waste
    per unit of work delta / tau + tau / (2M) (the checkpoint's share plus half an interval lost per failure).

    >>> round(young_interval(60.0, 3 * 3600.0))
    1138
    """
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly 2006's higher-order optimum checkpoint interval (eq. 37), seconds; M where delta >= 2M."""
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def wall_factor(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected wall time per second of work, T_wall / T (Daly 2006, eq. 13 / 20): M·e^(R/M)·(e^((tau+delta)/M)
    - 1) / tau. Infinite where the exponentials overflow (a job that, in expectation, never finishes)."""
    try:
        return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) / interval_s
    except OverflowError:
        return math.inf


def _positive(value: float, field: str, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise SpecError(f"{field} must be a positive finite number of {unit} (got {short_repr(value)})")
    return float(value)


def goodput_options(failure_rate_per_gpu_hour: float | None = None, node_write_bw_bytes_per_s: float | None = None,
                    aggregate_write_bw_bytes_per_s: float | None = None, restart_s: float | None = None
                    ) -> tuple[float, float, float | None, float]:
    """The goodput options checked, defaults filled in: (failure rate per GPU-hour, per-node write bytes/s,
    aggregate write bytes/s or None, restart seconds). A SpecError names a bad one."""
    rate = _positive(DEFAULT_FAILURE_RATE_PER_GPU_HOUR if failure_rate_per_gpu_hour is None
                     else failure_rate_per_gpu_hour, "failure_rate_per_gpu_hour", "failures per GPU-hour")
    node_bw = _positive(DEFAULT_NODE_WRITE_BW_BYTES_PER_S if node_write_bw_bytes_per_s is None
                        else node_write_bw_bytes_per_s, "node_write_bw_bytes_per_s", "bytes/s")
    aggregate = (None if aggregate_write_bw_bytes_per_s is None
                 else _positive(aggregate_write_bw_bytes_per_s, "aggregate_write_bw_bytes_per_s", "bytes/s"))
    restart = DEFAULT_RESTART_S if restart_s is None else restart_s
    if isinstance(restart, bool) or not isinstance(restart, (int, float)) or not 0 <= restart < math.inf:
        raise SpecError(f"restart_s must be a finite number of seconds >= 0 (got {short_repr(restart)})")
    return rate, node_bw, aggregate, float(restart)


def goodput(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, num_gpus: int,
            failure_rate_per_gpu_hour: float | None = None, node_write_bw_bytes_per_s: float | None = None,
            aggregate_write_bw_bytes_per_s: float | None = None, restart_s: float | None = None) -> Goodput:
    """The goodput of training `model` on `num_gpus` GPUs of `cluster`, checkpointing at Daly's optimum.

    Defaults: the Llama 3 405B run's failure rate (DEFAULT_FAILURE_RATE_PER_GPU_HOUR), the ASSUMED per-node write
    bandwidth (DEFAULT_NODE_WRITE_BW_BYTES_PER_S, nodes = GPUs / gpus_per_node rounded up) with no aggregate cap,
    and the ASSUMED restart time (DEFAULT_RESTART_S), to which reading the checkpoint back is added."""
    rate, node_bw, aggregate_bw, restart = goodput_options(failure_rate_per_gpu_hour, node_write_bw_bytes_per_s,
                                                           aggregate_write_bw_bytes_per_s, restart_s)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise SpecError(f"num_gpus must be a positive integer (got {short_repr(num_gpus)})")
    nodes = -(-num_gpus // cluster.gpus_per_node)
    bw = node_bw * nodes if aggregate_bw is None else min(node_bw * nodes, aggregate_bw)
    state = checkpoint_bytes(model, train)
    delta = state / bw
    mtbf = HOUR_S / (rate * num_gpus)
    tau = daly_interval(delta, mtbf)
    factor = wall_factor(tau, delta, mtbf, restart + delta)
    return Goodput(num_gpus=num_gpus, failure_rate_per_gpu_hour=rate, mtbf_s=mtbf, checkpoint_bytes=state,
                   checkpoint_bw_bytes_per_s=bw, checkpoint_s=delta, restart_s=restart + delta, interval_s=tau,
                   young_interval_s=young_interval(delta, mtbf), fraction=1.0 / factor)

