"""`meshplan tune` without real runs: the search space, and bad input refused in one line before the
study is written (exit 2, no traceback, the study unchanged)."""

from __future__ import annotations

import optuna
import pytest

from executors.tune.space import Space, build_space, seeds_of, strategy_for, strategy_key
import executors.tune.study as study_module
from executors.tune.study import JOB_ATTR, job_fingerprint, masked, open_storage, open_study
from planner import Strategy, plan
from planner.cli import main
from planner.errors import SpecError

MODEL = "tests/fixtures/tune/gpt-tiny.yaml"
JOB = ["--model", MODEL, "--cluster", "local-cpu", "--gpus", "2", "--global-batch-size", "4", "--seq-len", "32",
       "--precision", "fp32"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def planned():
    return plan(model=MODEL, cluster="local-cpu", num_gpus=2, global_batch_size=4, seq_len=32, precision="fp32",
                top_k=256, ranking="fastest")


def test_space_holds_the_pool_and_nothing_invariant(planned):
    pool = [p.strategy for p in planned.plans]
    space = build_space(pool)
    assert "dp" not in space.choices and "dp" not in space.fixed
    assert set(space.choices) <= set(space.names) and space.names
    for name, values in space.choices.items():
        assert len(values) > 1 and values == sorted(values, key=lambda v: (str(type(v)), v))
    assert all(space.holds(st) for st in pool)
    assert Space.from_attr(space.to_attr()) == space  # what the study stores comes back the same
    # a pool strategy comes back as itself (its non-tuned fields kept)
    first = pool[0]
    st, why = strategy_for({n: getattr(first, n) for n in space.names}, space, pool, 2)
    assert st == first and why == ""
    assert strategy_key(st) == strategy_key(first.model_copy())


def test_sampled_values_that_make_no_strategy_say_why(planned):
    pool = [p.strategy for p in planned.plans]
    space = build_space(pool)
    assert "tp" in space.choices and "pp" in space.choices
    params = {n: values[0] for n, values in space.choices.items()} | {"tp": 2, "pp": 2}
    st, why = strategy_for(params, space, pool, 2)
    assert st is None and "must divide the number of GPUs" in why


def test_seeds_are_the_top_k_then_near_ties_of_other_layouts():
    from executors.tune.space import layout_of

    ranked = plan(model=MODEL, cluster="local-cpu", num_gpus=2, global_batch_size=4, seq_len=32, precision="fp32",
                  top_k=64)
    assert len(ranked.worth_a_real_run) > 6  # a wide band holds many plans: seeding them all would be the budget
    seeds = seeds_of(ranked.plans, ranked.worth_a_real_run, 2, 3)
    assert seeds[:2] == [p.strategy for p in ranked.plans[:2]]
    extra = seeds[2:]
    assert 1 <= len(extra) <= 3
    assert all(layout_of(s) not in {layout_of(t) for t in seeds[:2]} for s in extra)
    assert len({layout_of(s) for s in extra}) == len(extra)
    ties = [ranked.plans[r - 1].strategy for r in ranked.worth_a_real_run]
    assert all(s in ties for s in extra)  # inside the top plan's band
    assert seeds_of(ranked.plans, ranked.worth_a_real_run, 2, 0) == seeds[:2]


def test_empty_pool_is_refused():
    with pytest.raises(SpecError, match="nothing to tune"):
        build_space([])


def test_password_is_masked():
    assert masked("postgresql+psycopg://me:secret@db.example:5432/tune") == "postgresql+psycopg://me:***@db.example:5432/tune"
    assert masked("sqlite:///tune.db") == "sqlite:///tune.db"


@pytest.mark.parametrize("flag, value, names", [
    ("--trials", "0", "--trials"),
    ("--top-k", "0", "--top-k"),
    ("--time-budget", "0", "--time-budget"),
    ("--steps", "0", "--steps"),
    ("--run-timeout", "-1", "--run-timeout"),
    ("--study-name", "a b/c", "--study-name"),
])
def test_bad_budgets_and_names(capsys, tmp_path, flag, value, names):
    db = tmp_path / "t.db"
    code, _, err = run(capsys, "tune", *JOB, "--storage", f"sqlite:///{db}", flag, value)
    line = one_line_error(code, err)
    assert names in line
    assert not db.exists() or not optuna.get_all_study_summaries(f"sqlite:///{db}")


def test_unreachable_storage(capsys):
    # nothing listens on port 1 of the loopback address
    code, _, err = run(capsys, "tune", *JOB, "--storage", "postgresql+psycopg://meshplan:pw@127.0.0.1:1/tune")
    line = one_line_error(code, err)
    assert "--storage" in line and "cannot open" in line and "pw" not in line and "***" in line


@pytest.mark.parametrize("url, words", [
    ("tune.db", "must be a database URL"),
    ("sqlite:///{tmp}/missing/t.db", "does not exist"),
    ("nosuchdialect://x/y", "cannot open"),
])
def test_malformed_storage(capsys, tmp_path, url, words):
    code, _, err = run(capsys, "tune", *JOB, "--storage", url.format(tmp=tmp_path))
    assert words in one_line_error(code, err)


def test_grace_period_must_exceed_the_heartbeat(capsys, tmp_path):
    code, _, err = run(capsys, "tune", *JOB, "--storage", f"sqlite:///{tmp_path}/t.db", "--heartbeat", "5",
                       "--grace-period", "5")
    assert "--grace-period" in one_line_error(code, err)


def _study_of_another_job(url: str, name: str) -> optuna.Study:
    other = plan(model=MODEL, cluster="local-cpu", num_gpus=2, global_batch_size=8, seq_len=32, precision="fp32",
                 top_k=1)
    fingerprint = job_fingerprint(other.model, other.cluster, other.train, 2, {}, "torch", None)
    study = open_study(open_storage(url), name, fingerprint, url, optuna.samplers.TPESampler())
    study.enqueue_trial({"tp": 1})
    return study


def test_a_study_of_another_job_is_refused_and_left_as_it_was(capsys, tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    before = _study_of_another_job(url, "shared")
    attrs, trials = dict(before.user_attrs), len(before.trials)
    code, _, err = run(capsys, "tune", *JOB, "--storage", url, "--study-name", "shared")
    line = one_line_error(code, err)
    assert "belongs to another job" in line and "global_batch_size 8 (this run: 4)" in line
    after = optuna.load_study(study_name="shared", storage=url)
    assert after.user_attrs == attrs and len(after.trials) == trials


def test_a_study_not_made_by_meshplan_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(study_module, "CREATION_WAIT_S", 0.5)  # no worker is creating it: no need to wait long
    url = f"sqlite:///{tmp_path}/t.db"
    optuna.create_study(storage=url, study_name="mine", direction="maximize")
    code, _, err = run(capsys, "tune", *JOB, "--storage", url, "--study-name", "mine")
    assert "not created by `meshplan tune`" in one_line_error(code, err)
    assert JOB_ATTR not in optuna.load_study(study_name="mine", storage=url).user_attrs


def test_calibration_with_a_negative_bandwidth_is_refused(capsys, tmp_path):
    cal = tmp_path / "cal.yaml"
    cal.write_text("intra_node_bw_gb_per_s: -5\n")
    db = tmp_path / "t.db"
    code, _, err = run(capsys, "tune", *JOB, "--storage", f"sqlite:///{db}", "--calibration", str(cal))
    line = one_line_error(code, err)
    assert "intra_node_bw_gb_per_s" in line
    assert not db.exists() or not optuna.get_all_study_summaries(f"sqlite:///{db}")


def test_nothing_fits_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "tune", "--model", "llama3-70b", "--cluster", "local-cpu", "--gpus", "2",
                       "--global-batch-size", "4", "--seq-len", "32", "--storage", f"sqlite:///{tmp_path}/t.db")
    assert code != 0 and "Traceback" not in err
    assert "nothing to tune" in err or "fit" in err


def test_strategy_key_tells_strategies_apart():
    a = Strategy(dp=2).resolve(2)
    b = Strategy(dp=2, zero_stage=1).resolve(2)
    assert strategy_key(a) != strategy_key(b) and strategy_key(a) == strategy_key(Strategy(dp=2).resolve(2))


def test_the_engine_follows_the_plans_framework_where_it_can_run():
    from executors.tune.tuner import resolve_engine
    from profiles import load_model

    dense, moe = load_model("llama3-8b"), load_model("mixtral-8x7b")
    assert resolve_engine("auto", "cuda", "megatron", dense) == ("megatron", "")
    assert resolve_engine("auto", "cuda", "deepspeed", dense) == ("deepspeed", "")
    engine, note = resolve_engine("auto", "cuda", "megatron", moe)
    assert engine == "torch" and "dense layers only" in note
    engine, note = resolve_engine("auto", "cpu", "megatron", dense)
    assert engine == "torch" and "needs CUDA" in note
    assert resolve_engine("auto", "cuda", "torchtitan", dense) == ("torch", "")
    assert resolve_engine("deepspeed", "cpu", "megatron", dense) == ("deepspeed", "")


def test_an_engine_that_cannot_run_here_is_refused_before_the_study(capsys, tmp_path):
    db = tmp_path / "t.db"
    code, _, err = run(capsys, "tune", *JOB, "--storage", f"sqlite:///{db}", "--engine", "megatron", "--device", "cpu")
    line = one_line_error(code, err)
    assert "needs CUDA" in line
    assert not db.exists() or not optuna.get_all_study_summaries(f"sqlite:///{db}")


def test_a_worker_waits_for_the_one_creating_the_study(tmp_path):
    """optuna creates a study and writes its attributes in separate transactions: a second worker that finds the
    study in between waits for its job instead of calling it foreign."""
    import threading

    url = f"sqlite:///{tmp_path}/t.db"
    storage = open_storage(url)
    created = optuna.create_study(storage=storage, study_name="race", direction="maximize")
    job = plan(model=MODEL, cluster="local-cpu", num_gpus=2, global_batch_size=4, seq_len=32, precision="fp32", top_k=1)
    fingerprint = job_fingerprint(job.model, job.cluster, job.train, 2, {}, "torch", None)
    writer = threading.Timer(1.0, lambda: created.set_user_attr(JOB_ATTR, fingerprint))
    writer.start()
    try:
        study = open_study(storage, "race", fingerprint, url, optuna.samplers.TPESampler())
    finally:
        writer.join()
    assert study.user_attrs[JOB_ATTR] == fingerprint
