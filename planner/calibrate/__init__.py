"""Calibration: fit a few named physical parameters of the cost model on measured runs.

    from planner.calibrate import MeasuredRun, FitParameter, FitSettings, calibrate
    runs = [MeasuredRun(label="8b n8", source="my cluster, 2025-06", model="llama3-8b", cluster="dgx-h100",
                        num_gpus=8, global_batch_size=64, seq_len=8192, measured_step_s=6.1,
                        strategy={"tp": 1, "pp": 1})]
    result = calibrate(runs, FitSettings(parameters=(FitParameter(name="sustained_compute_fraction",
                                                                  lower=0.5, upper=1.0),)))

`runs` holds MeasuredRun and prediction; `fit` the least-squares engine, `calibrate` and
`leave_one_set_out`; `profile` writes a result as a calibration profile (a GPU's, or a user
calibration file that `profiles.load_calibration` and `--calibration` read).
"""

from planner.calibrate.fit import (
    CalibrationResult,
    ErrorSummary,
    FitParameter,
    FitSettings,
    HeldOutSet,
    ParameterFit,
    Residual,
    calibrate,
    fit_parameters,
    leave_one_set_out,
    run_residuals,
)
from planner.calibrate.profile import (
    calibration_document,
    fitted_on_text,
    parameter_document,
    user_calibration_document,
    write_calibration_profile,
)
from planner.calibrate.runs import (
    MeasuredRun,
    RunPrediction,
    apply_parameters,
    predict_run,
    run_settings,
)

__all__ = [
    "CalibrationResult", "ErrorSummary", "FitParameter", "FitSettings", "HeldOutSet", "MeasuredRun", "ParameterFit",
    "Residual", "RunPrediction", "apply_parameters", "calibrate", "calibration_document", "fit_parameters",
    "fitted_on_text", "leave_one_set_out", "parameter_document", "predict_run", "run_residuals", "run_settings",
    "user_calibration_document", "write_calibration_profile",
]
