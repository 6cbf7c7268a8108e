"""Fit each newer GPU generation's one end-to-end parameter on a small named set of published runs.

    python -m benchmarks.generations           # fit, print, write profiles/calibration/<gpu>.yaml
    python -m benchmarks.generations --check   # fit and print only

On a GPU with kernel tables (profiles/kernels/) every part of the step is timed from kernel-level
measurements: GEMMs by shape, attention kernels, element-wise and host costs, collectives. What
those micro-benchmarks do not see is how much of that throughput a GPU sustains in a training run:
the power limit lowers clocks when every SM computes back to back, and the kernels run beside
communication kernels. That is one number per GPU generation, `sustained_compute_fraction`, which
scales the table-timed compute only.

It is fitted on the runs whose step is most nearly all compute: for each generation the largest
dense models of the newest published set (Megatron-Bridge 25.11), named in `GENERATION_FITS`
before any fit was run. Their step time is dominated by large GEMMs and attention, the terms the
parameter scales; small models, MoE models and other sets are left out and judged
(`python -m benchmarks.accuracy` reports them, and prints the fitted rows as calibration rows).
The least-squares fit (planner.calibrate.calibrate, plain quadratic loss on the relative errors)
is bounded to [0.5, 1]: below 0.5 a GPU would sustain less than half its
measured kernel rate, which no published clock or power measurement supports; 1 is the tables'
own rate.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace


from benchmarks.calibration import base_cluster
from benchmarks.ep_overlap import FIT_ROWS as EP_OVERLAP_FIT_ROWS
from benchmarks.validation import StepCase, measured_run, public_runs
from benchmarks.zero3 import FIT_ROWS as ZERO3_FIT_ROWS
from planner.calibrate import (
    CalibrationResult,
    FitParameter,
    FitSettings,
    MeasuredRun,
    calibrate,
    parameter_document,
    write_calibration_profile,
)
from profiles import PROFILES_DIR

PARAMETER = "sustained_compute_fraction"
BOUNDS = (0.5, 1.0)
DECIMALS = 4


@dataclass(frozen=True)
class GenerationFit:
    key: str
    gpus: tuple[str, ...]  # calibration files written (same silicon)
    rows: tuple[tuple[str, str], ...]  # (public set, row label)
    why: str


GENERATION_FITS = {
    "H100-H200": GenerationFit(
        "H100-H200", ("h100-sxm", "h200"),
        (("mbridge_25_11", "llama3-8b dgx-h100 FP8-CS n8 s8192 tp1 pp1 cp1 vp1 fsdp8"),
         ("mbridge_25_11", "llama3-70b dgx-h100 FP8-CS n64 s8192 tp4 pp8 cp1 vp5"),
         ("mbridge_25_11", "llama3.1-405b dgx-h100 FP8-CS n1024 s8192 tp8 pp8 cp2 vp8")),
        "the dense models on DGX-H100 in Megatron-Bridge 25.11, 8B to 405B; the H200 (same GH100 compute die and "
        "clocks, 700 W) has no published run meshplan can predict, so it takes the H100 value"),
    "B200": GenerationFit(
        "B200", ("b200",),
        (("mbridge_25_11", "llama3-8b dgx-b200 FP8-CS n8 s8192 tp1 pp1 cp1 vp1"),
         ("mbridge_25_11", "llama3.1-405b dgx-b200 FP8-CS n128 s8192 tp4 pp8 cp2 vp8")),
        "the smallest and the largest dense model on DGX-B200 in Megatron-Bridge 25.11, FP8 current scaling"),
    "GB200": GenerationFit(
        "GB200", ("gb200",),
        (("mbridge_25_11", "llama3-8b gb200-nvl72 FP8-CS n8 s8192 tp1 pp1 cp1 vp1"),
         ("mbridge_25_11", "llama3.1-405b gb200-nvl72 FP8-CS n256 s8192 tp4 pp16 cp1 vp4")),
        "the smallest and the largest dense model on GB200 NVL72 in Megatron-Bridge 25.11, FP8 current scaling; "
        "the 70B row is not a calibration row: {offload}"),
    "GB300": GenerationFit(
        "GB300", ("gb300",),
        (("mbridge_25_11", "llama3-8b gb300-nvl72 FP8-CS n8 s8192 tp1 pp1 cp1 vp1"),
         ("mbridge_25_11", "llama3.1-405b gb300-nvl72 FP8-CS n256 s8192 tp2 pp8 cp2 vp4")),
        "the smallest and the largest dense model on GB300 NVL72 in Megatron-Bridge 25.11, FP8 current scaling (the "
        "rows chosen for GB200, on the GB300 rack); the 70B row is not a calibration row: {offload}"),
}
#: Why the Llama 3 70B FSDP rows of the Grace-based racks are not calibration rows: their runs offload the
#: activations of part of the layers to the host (Megatron's --cpu-offloading), which meshplan does not model
#: (it would recompute instead, so those rows measure a mechanism the fit must not absorb).
OFFLOAD = ("its run offloads activations to the Grace CPU (Megatron-Bridge scripts/performance/configs/llama3/"
           "workload_base_configs.py at 06a9d1d9, NVIDIA-NeMo/Megatron-Bridge: LLAMA3_70B_GB200_FP8_CS_BASE_CONFIG "
           "cpu_offloading_num_layers 40, LLAMA3_70B_GB300_FP8_CS_BASE_CONFIG 20), a mechanism meshplan does not "
           "model")
GENERATION_FITS = {k: replace(f, why=f.why.replace("{offload}", OFFLOAD)) for k, f in GENERATION_FITS.items()}

#: The second fitted parameter, for the x86 DGX hosts only: a factor on their element-wise tables' host-time
#: figures (`GpuSpec.host_time_scale`). Those figures are the least-sourced numbers of the tables: the issue cost
#: per kernel comes from inference decode (no autograd), the grouped MLP's per-expert set-up from a Grace
#: measurement divided by the Grace / x86 ratio of one torch.nn.Linear, the per-expert GEMM call from a benchmark
#: whose host is not named. Fitted after the generations' `sustained_compute_fraction` (with it) on the x86 runs
#: whose predicted step is most nearly all host time; bounded to [1, 2.75]: 1 is the tables' figures, 2.75 an
#: x86 host as slow as Grace at this work (the ratio the per-expert figures were divided by).
HOST_PARAMETER = "host_time_scale"
HOST_BOUNDS = (1.0, 2.75)
HOST_FIT = GenerationFit(
    "x86 hosts", ("b200", "h100-sxm", "h200"),
    (("mbridge_25_11", "qwen3-30b-a3b dgx-b200 FP8-MX n8 s4096 tp1 pp1 cp1 vp1 ep8"),
     ("mbridge_26_02", "qwen3-30b-a3b dgx-b200 MXFP8 n8 s4096 tp1 pp1 cp1 vp1 ep8")),
    "the published x86-host runs whose predicted step is most nearly all host time: Qwen3-30B-A3B dropless at "
    "micro-batch 1 on one DGX-B200 (16 local experts, the all-to-all dispatcher, no pipeline, no expert traffic "
    "off the node), the same preset in Megatron-Bridge 25.11 and 26.02. Chosen after the B200 residuals were "
    "examined (every x86 MoE row with 16-32 local experts too fast, every row with 2-8 within about 8 %), not "
    "before any fit as the generations' rows were; the DGX-H100 and DGX-H200 hosts take the value (x86 servers "
    "of the same class) and their rows judge it")


def calibration_rows() -> set[tuple[str, str]]:
    """Every (set, label) some fit uses (the generations' `sustained_compute_fraction`, the x86 hosts'
    `host_time_scale`, the EP-overlap share of benchmarks/ep_overlap.py, DeepSpeed's ZeRO-3 cross-node rate of
    benchmarks/zero3.py, whose set is the accuracy report's table name): the accuracy report prints them as
    fitted."""
    return ({row for f in (*GENERATION_FITS.values(), HOST_FIT) for row in f.rows} | set(EP_OVERLAP_FIT_ROWS)
            | set(ZERO3_FIT_ROWS))


def cases_of(fit: GenerationFit) -> list[StepCase]:
    out = []
    for set_name, label in fit.rows:
        found = [c for c in public_runs(set_name).cases if c.label == label]
        if len(found) != 1:
            raise SystemExit(f"calibration row {label!r} of {set_name} not found (or refused)")
        out.append(found[0])
    return out


def runs_of(fit: GenerationFit) -> list[MeasuredRun]:
    """`fit`'s rows as the package's measured runs (source: the published set)."""
    return [measured_run(c, set_name) for (set_name, _), c in zip(fit.rows, cases_of(fit))]


def settings(parameter: str = PARAMETER, bounds: tuple[float, float] = BOUNDS, fixed: dict | None = None) -> FitSettings:
    """Least squares of the relative step-time errors (the plain quadratic loss) over `parameter` in `bounds`."""
    return FitSettings(parameters=(FitParameter(name=parameter, lower=bounds[0], upper=bounds[1]),),
                       fixed=dict(fixed or {}), loss="linear", error="relative", decimals=DECIMALS)


def fit_generation(fit: GenerationFit, parameter: str = PARAMETER, bounds: tuple[float, float] = BOUNDS,
                   fixed: dict | None = None) -> CalibrationResult:
    """Bounded least squares of `fit`'s rows' relative errors over `parameter` (the others at `fixed`),
    with every row's error under the fitted value (planner.calibrate.calibrate)."""
    return calibrate(runs_of(fit), settings(parameter, bounds, fixed))


def describe(fit: GenerationFit) -> str:
    return f"{'; '.join(f'{s}: {label}' for s, label in fit.rows)} (why these: {fit.why})"


def write(fit: GenerationFit, result: CalibrationResult, bounds: tuple[float, float] = BOUNDS) -> None:
    method = ("python -m benchmarks.generations: bounded least squares of the relative step-time errors, "
              f"bounds {list(bounds)}")
    for gpu in fit.gpus:
        write_calibration_profile(PROFILES_DIR / "calibration" / f"{gpu}.yaml",
                                  parameter_document(result, method, describe(fit)), shipped=True)


def _report(key: str, result: CalibrationResult) -> None:
    (parameter,) = result.fitted
    print(f"{key}: {parameter} = {result.values[parameter]} on {len(result.residuals)} rows")
    for r in result.residuals:
        print(f"  {r.row:70s} {r.error:+.1%}")


def main(argv: list[str]) -> int:
    check = "--check" in argv
    sustained = {}
    for fit in GENERATION_FITS.values():
        # with the x86 hosts' shipped host_time_scale (the dense fit rows barely depend on it)
        result = fit_generation(fit)
        sustained.update({gpu: result.values[PARAMETER] for gpu in fit.gpus})
        _report(fit.key, result)
        if not check:
            write(fit, result)
    # the host fit's rows run on one GPU kind: its sustained fraction as just fitted
    gpu_of_rows = {cases_of(HOST_FIT)[0].cluster}
    fixed = {PARAMETER: sustained[base_cluster(gpu_of_rows.pop()).gpu.kernel_tables]}
    result = fit_generation(HOST_FIT, HOST_PARAMETER, HOST_BOUNDS, fixed)
    _report(HOST_FIT.key, result)
    if not check:
        write(HOST_FIT, result, HOST_BOUNDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
