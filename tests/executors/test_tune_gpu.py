"""`meshplan tune` on GPUs: the same study, its trials on NCCL with CUDA memory measured. Skipped
without CUDA (the reason is printed with pytest -rs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor_fixtures import TINY  # noqa: E402

from executors.tune import TuneOptions, tune  # noqa: E402
from executors.validate import ValidateOptions  # noqa: E402
from planner.errors import SpecError  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.executor,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the tuner's NCCL path runs only on a GPU"),
]


def test_a_study_on_one_gpu(tmp_path):
    options = TuneOptions(storage=f"sqlite:///{tmp_path}/tune.db", n_trials=3, top_k=3, calibrate_every=2,
                          run=ValidateOptions(device="cuda", timed_steps=3, warmup_steps=1, timeout_s=600))
    report = tune(TINY, "dgx-h100", 1, 8, 64, precision="bf16", options=options)
    ok = [r for r in report.trials if r.status == "ok"]
    assert ok, [(r.number, r.status, r.reason) for r in report.trials]
    for r in ok:
        assert r.measured_step_s > 0 and r.measured_peak_memory_bytes and r.measured_peak_memory_bytes > 0
    assert report.best is not None and report.best_configs


def test_more_ranks_than_this_node_has_gpus_is_refused(tmp_path):
    here = torch.cuda.device_count()
    options = TuneOptions(storage=f"sqlite:///{tmp_path}/tune.db", n_trials=1,
                          run=ValidateOptions(device="cuda"))
    with pytest.raises(SpecError, match="a tuner trial runs on one node"):
        tune(TINY, "dgx-h100", 2 * here if here else 2, 8 * here, 64, precision="bf16", options=options)
