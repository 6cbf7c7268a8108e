"""Golden end-to-end accuracy against published runs (../shared/validation).

The A100 efficiencies in profiles/calibration/a100-80gb.yaml were fitted on
Korthikanti et al. 2022 Table 4 (both) and SC'21 Table 2's PTD rows (GEMM
efficiency only), by benchmarks/calibrate.py. The rows tested here are held
out: SC'21 Table 1 and Korthikanti Table 5, compared as step times (SC'21's
hardware TFLOP/s turned into step times with its own Eq. 3).
Targets (issue 2): median |error| <= 7 %, max <= 15 % on each table.
"""

from __future__ import annotations

import statistics

import pytest
import yaml

from benchmarks.calibration import fit_efficiencies
from benchmarks.validation import (
    MEGATRON_2022,
    korthikanti_table4,
    korthikanti_table5,
    predict,
    sc21_table1,
    sc21_table2,
    torchtitan_fsdp2,
)
from profiles import PROFILES_DIR, load_cluster, load_gpu


def _errors(cases):
    preds = [predict(c) for c in cases]
    assert all(p.predicted_step_s is not None for p in preds), [p.note for p in preds if p.predicted_step_s is None]
    return [abs(p.error) for p in preds]


@pytest.mark.parametrize("table,loader,rows", [("SC'21 Table 1", sc21_table1, 10),
                                               ("Korthikanti Table 5", korthikanti_table5, 8),
                                               # FSDP2 (ZeRO-3) on 64 A100s, torchtitan docs/performance.md;
                                               # held out like the others, same targets.
                                               ("torchtitan FSDP2", torchtitan_fsdp2, 5)])
def test_step_time_targets(validation_path, table, loader, rows):
    errors = _errors(loader())
    assert len(errors) == rows
    assert statistics.median(errors) <= 0.07, f"{table}: median {statistics.median(errors):.3f}"
    assert max(errors) <= 0.15, f"{table}: max {max(errors):.3f}"


def test_ptd_beats_zero3_for_530b_as_published(validation_path):
    # SC'21 Table 2: at 1120 GPUs PTD (tp8 pp35) is faster than ZeRO-3 for the 530B model.
    t2 = {c.label: c for c in sc21_table2()}
    ptd = predict(t2["529.6B PTD n1120 mbs1"])
    assert ptd.predicted_step_s < t2["529.6B ZeRO-3 n1120 mbs2"].measured_step_s


def test_calibration_file_is_what_the_fit_gives(validation_path):
    """The shipped efficiencies are reproducible from the documented rows (no hand tuning)."""
    doc = yaml.safe_load((PROFILES_DIR / "calibration" / "a100-80gb.yaml").read_text())
    base = load_cluster("dgx-a100-80gb")
    ptd = [c for c in sc21_table2() if c.constraints["zero_stage"] == 0]
    fit = fit_efficiencies(korthikanti_table4(), ptd, base, MEGATRON_2022)
    assert fit.gemm_efficiency == pytest.approx(doc["gemm_efficiency"], abs=2e-3)
    assert fit.hbm_efficiency == pytest.approx(doc["hbm_efficiency"], abs=2e-3)
    assert load_gpu("a100-80gb").gemm_efficiency == doc["gemm_efficiency"]
    assert "Table 4" in load_gpu("a100-80gb").calibration
