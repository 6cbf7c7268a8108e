"""The auto-tuner: analytic ranking, short real runs in an Optuna study, calibration fed back.

    from executors.tune import TuneOptions, tune
    report = tune("llama3-8b", "dgx-h100", num_gpus=8, global_batch_size=64, seq_len=8192,
                  options=TuneOptions(storage="sqlite:///tune.db", n_trials=8))

`planner.tune` is the same function. `space` turns the analytic search into Optuna parameters,
`measure` runs one trial, `feedback` fits the calibration and reacts to OOMs, `study` opens the
storage and checks that a study belongs to the job, `tuner` runs the loop.
"""

from executors.tune.tuner import TrialRecord, TuneOptions, TuneReport, tune

__all__ = ["TrialRecord", "TuneOptions", "TuneReport", "tune"]
