"""Comparing plans (planner.show.compare, `Plan.compare`, `meshplan compare`), the candidate table the search
hands over (PlanResult.candidates), each plan's per-stage figures (Estimate.stages) and the candidates set aside
by reason with their nearest misses (planner.misses)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cost_models.arrays import StrategyArrays
from cost_models.step import evaluate_arrays, stage_breakdown
from planner import evaluate, plan
from planner.api import make_inputs
from planner.cli import main
from planner.errors import SpecError
from planner.misses import rejected_by_reason
from planner.rules import RULES, Context, check
from planner.show.compare import NAMED_SHARE, compare_estimates
from planner.show.labels import TIME_TERM_WORDS, time_word
from planner.specs import Plan, PlanResult, Strategy

# Two published layouts of one question: Llama 3.1 405B pre-training on 256 GB300 GPUs (NVL72), global batch
# 1536 x 8192, Megatron-Bridge's 26.06 performance table (NVIDIA-NeMo/Megatron-Bridge
# docs/performance-summary-archive.md at 067f987d, benchmarks/data/mbridge_26_06.json): its FP8-CS row runs
# tp 4 pp 8 vp 4, its MXFP8 row tp 2 pp 8 cp 2 vp 4, both micro-batch 1. Compared here under one precision (fp8);
# 126 layers on pp 8 x vp 4 need the embedding and the loss counted as layers, as Megatron-Bridge's Llama 3.1 405B
# recipes do (account_for_embedding/loss_in_pipeline_split).
QUESTION = dict(model="llama3.1-405b", cluster="gb300-nvl72", num_gpus=256, global_batch_size=1536, seq_len=8192,
                precision="fp8")
SPLIT = dict(embedding_as_layer=True, loss_as_layer=True)
PUBLISHED_A = dict(tp=4, pp=8, cp=1, vpp=4, sequence_parallel=True, zero_stage=1, micro_batch_size=1, **SPLIT)
PUBLISHED_B = dict(tp=2, pp=8, cp=2, vpp=4, sequence_parallel=True, zero_stage=1, micro_batch_size=1, **SPLIT)


def _as_plan(strategy: dict, rank: int) -> Plan:
    est = evaluate(strategy=strategy, **QUESTION)
    assert est.valid and est.fits, est.reasons
    assert len(est.stages) == strategy["pp"]
    model, cluster, train = make_inputs(**QUESTION)
    return Plan(rank=rank, strategy=Strategy(**strategy).resolve(QUESTION["num_gpus"]), estimate=est, model=model,
                cluster=cluster, train=train.model_copy(update=est.settings), num_gpus=QUESTION["num_gpus"])


@pytest.fixture(scope="module")
def published() -> tuple[Plan, Plan]:
    return _as_plan(PUBLISHED_A, 1), _as_plan(PUBLISHED_B, 2)


def _pct(text: str) -> float:
    return float(text) / 100


def test_the_sentence_names_the_dominant_term_with_the_breakdowns_numbers(published):
    a, b = published
    c = a.compare(b)
    ea, eb = a.estimate, b.estimate
    # the terms add up to the steps, so their differences add up to the step difference
    assert sum(d.difference for d in c.time) == pytest.approx(eb.step_time_s - ea.step_time_s, rel=1e-9, abs=1e-12)
    slow, fast = (eb, ea) if c.faster == "a" else (ea, eb)
    losses = {t: slow.time_s[t] - fast.time_s[t] for t in slow.time_s}
    dominant = max(losses, key=losses.get)
    assert c.dominant_term == dominant
    faster_step = min(ea.step_time_s, eb.step_time_s)
    slow_name, fast_name = ("#2", "#1") if c.faster == "a" else ("#1", "#2")
    gap = re.match(rf"{slow_name} is ([\d.]+)% slower than {fast_name} \(([\d.]+) s vs ([\d.]+) s per step\)",
                   c.sentence)
    assert gap, c.sentence
    assert _pct(gap.group(1)) == pytest.approx(slow.step_time_s / faster_step - 1, abs=0.006)
    assert float(gap.group(2)) == pytest.approx(slow.step_time_s, abs=6e-4)
    assert float(gap.group(3)) == pytest.approx(fast.step_time_s, abs=6e-4)
    # the first term named is the dominant one, with its share of the faster step
    first = re.search(r"it loses ([\d.]+)% to (.+?)(?: \(|,| and |$)", c.sentence)
    assert first, c.sentence
    assert first.group(2) == time_word(dominant)
    assert _pct(first.group(1)) == pytest.approx(losses[dominant] / faster_step, abs=0.006)
    # every term named as lost is a real loss above the naming threshold, every one named as gained a real gain
    for share, word in re.findall(r"([\d.]+)% to ([a-z][a-z\- ]+?)(?= \(|,| and |$)", c.sentence.split(", and gains")[0]):
        term = next(t for t, w in TIME_TERM_WORDS.items() if w == word)
        assert losses[term] / faster_step == pytest.approx(_pct(share), abs=0.006)
        assert losses[term] / faster_step >= NAMED_SHARE


def test_the_comparison_is_the_same_either_way_round(published):
    a, b = published
    ab, ba = a.compare(b), b.compare(a)
    assert ab.sentence == ba.sentence
    assert ab.dominant_term == ba.dominant_term
    assert [d.difference for d in ab.time] == pytest.approx([-d.difference for d in ba.time])


def test_the_memory_sentence_names_the_terms_that_differ_most(published):
    a, b = published
    c = a.compare(b)
    dm = b.estimate.peak_memory_bytes - a.estimate.peak_memory_bytes
    more = "#2" if dm > 0 else "#1"
    assert c.memory_sentence.startswith(f"{more} needs {abs(dm) / 2**30:.1f} GiB more per GPU")
    biggest = c.memory[0]
    assert abs(biggest.difference) == max(abs(d.difference) for d in c.memory)


def test_equal_plans_are_called_equal():
    est = evaluate(strategy=PUBLISHED_A, **QUESTION)
    c = compare_estimates(est, est)
    assert c.faster is None and c.dominant_term is None
    assert "equally fast" in c.sentence
    assert "same memory" in c.memory_sentence


def test_compare_takes_plans_only(published):
    with pytest.raises(SpecError, match="another Plan"):
        published[0].compare(published[0].estimate)


# ---- the candidate table -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama70b() -> PlanResult:
    return plan("llama3-70b", "dgx-h100", 64, 128, 8192, top_k=5)


def test_the_search_hands_over_every_candidate(llama70b):
    table = llama70b.candidates
    st = llama70b.stats
    assert len(table) == st.num_valid
    assert int(table.fits.sum()) == st.num_feasible
    # every reason but fitting is counted in stats.rejected under the same key, with the same count
    labels, counts = np.unique(table.reason[~table.fits], return_counts=True)
    for code, n in zip(labels, counts):
        assert st.rejected[table.reason_labels[code]] == n
    # the ranked plans are candidates of the table with the same figures
    for p in llama70b.plans:
        i = int(np.argmin(np.abs(table.step_time_s - p.estimate.step_time_s)))
        assert table.step_time_s[i] == pytest.approx(p.estimate.step_time_s, rel=1e-12)
        assert table.peak_memory_bytes[i] == pytest.approx(p.estimate.peak_memory_bytes, rel=1e-12)
    best = int(np.argmax(table.tokens_per_s_per_gpu))
    assert table.fits[best]
    assert table.tokens_per_s_per_gpu[best] == pytest.approx(max(p.estimate.tokens_per_s_per_gpu
                                                                 for p in llama70b.plans), rel=0.05)


def test_the_pareto_front_is_undominated_and_complete(llama70b):
    table = llama70b.candidates
    front = table.pareto()
    fit = np.flatnonzero(table.fits)
    t, m = table.step_time_s, table.peak_memory_bytes
    for i in front:  # no fitting candidate is as fast with less memory, or faster with no more
        dominated = ((t[fit] <= t[i]) & (m[fit] < m[i])) | ((t[fit] < t[i]) & (m[fit] <= m[i]))
        assert not dominated.any()
    # and every undominated candidate is on it (up to exact ties, which keep one)
    rng = np.random.default_rng(0)
    for i in rng.choice(fit, size=min(300, len(fit)), replace=False):
        if i in front:
            continue
        assert (((t[fit] <= t[i]) & (m[fit] <= m[i])) & ((t[fit] < t[i]) | (m[fit] < m[i]))).any() or \
            any(t[j] == t[i] and m[j] == m[i] for j in front)


def test_a_result_read_back_from_json_has_no_candidate_table(llama70b):
    again = PlanResult.model_validate(json.loads(llama70b.model_dump_json()))
    assert again == llama70b  # the table is not part of the result's fields
    with pytest.raises(SpecError, match="candidate table"):
        again.candidates
    with pytest.raises(SpecError, match="candidate table"):
        rejected_by_reason(again)


# ---- per-stage figures ------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [
    dict(tp=8, pp=8, vpp=3, sequence_parallel=True, zero_stage=1),
    dict(tp=8, pp=16, sequence_parallel=True, zero_stage=1, recompute="full"),
    dict(tp=4, pp=4, sequence_parallel=True, num_layers_in_first_stage=22, num_layers_in_last_stage=26),
])
def test_stage_figures_add_up_to_the_step(strategy):
    question = ("gpt3-175b", "dgx-a100-80gb", 1024, 1536, 2048)
    est = evaluate(*question, strategy=strategy)
    stages = est.stages
    s = Strategy(**strategy).resolve(1024)
    assert len(stages) == s.pp and [x.pipeline_rank for x in stages] == list(range(s.pp))
    assert sum(x.layers for x in stages) == 96
    per_micro = max(x.forward_s + x.backward_s for x in stages)
    layers_terms = sum(est.time_s[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm",
                                               "activation_offload"))
    assert per_micro * est.num_microbatches == pytest.approx(layers_terms, rel=1e-9)
    assert all(x.forward_s > 0 and x.backward_s > x.forward_s for x in stages)  # a backward is about twice
    # the binding rank's memory is the estimate's
    assert stages[est.binding_pipeline_rank].peak_memory_bytes == pytest.approx(est.peak_memory_bytes, rel=1e-9)
    assert max(x.peak_memory_bytes for x in stages) == pytest.approx(est.peak_memory_bytes, rel=1e-9)


def test_middle_ranks_hold_fewer_micro_batches_down_the_pipeline():
    """Spelled out rank by rank, an even 1F1B pipeline's activations fall from rank 1 to rank pp-2 (each holds
    one micro-batch fewer in flight), and ranks 0, 1 and pp-1 keep the cost model's own rows."""
    model, cluster, train = make_inputs("gpt3-175b", "dgx-a100-80gb", 1024, 1536, 2048)
    st = StrategyArrays.from_strategies([Strategy(tp=8, pp=16, sequence_parallel=True, zero_stage=1).resolve(1024)])
    stages = stage_breakdown(model, cluster, train, st)[0]
    act = [x["memory_bytes"]["activations"] for x in stages]
    assert all(a > b for a, b in zip(act[1:-1], act[2:-1]))
    costs = evaluate_arrays(model, cluster, train, st)
    assert max(x["peak_memory_bytes"] for x in stages) == pytest.approx(float(costs.peak_memory_bytes[0]), rel=1e-9)


# ---- candidates set aside, by reason ----------------------------------------------------------------
def test_every_reason_is_listed_with_its_count_and_nearest_miss(llama70b):
    misses = rejected_by_reason(llama70b)
    assert {m.reason: m.count for m in misses} == llama70b.stats.rejected
    table = llama70b.candidates
    ctx = Context(llama70b.model, llama70b.train, llama70b.num_gpus, llama70b.cluster)
    rules = {r.key: r for r in RULES}
    for m in misses:
        if m.kind == "memory" and not m.reason.startswith("host"):
            code = table.reason_labels.index(m.reason)
            rows = np.flatnonzero(table.reason == code)
            least = float(np.min(table.peak_memory_bytes[rows]))
            assert m.peak_memory_bytes == pytest.approx(least, rel=1e-12)  # the smallest excess
            assert m.peak_memory_bytes > table.memory_limit_bytes
            assert m.step_time_s > 0 and np.isfinite(m.step_time_s)
            assert m.versus_best == pytest.approx(m.step_time_s / llama70b.plans[0].estimate.step_time_s - 1)
        elif m.kind == "rule" and m.nearest is not None:
            one = StrategyArrays.from_strategies([m.nearest])
            _, failures = check(ctx, one)
            assert failures[m.reason][0]  # it does break the rule it is listed under
            assert m.detail == rules[m.reason].message(ctx, one.row(0))


def test_a_memory_miss_not_timed_by_the_search_is_scored(llama70b):
    """Candidates over the limit are not timed by a large search; their nearest miss gets its step here."""
    big = plan("gpt3-175b", "dgx-a100-80gb", 1024, 1536, 2048, top_k=1)
    over = big.candidates.reason > 2
    assert np.isinf(big.candidates.step_time_s[over]).any()
    for m in rejected_by_reason(big):
        if m.kind == "memory":
            assert m.step_time_s is not None and np.isfinite(m.step_time_s)


# ---- the command ------------------------------------------------------------------------------------
ARGS = ["--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size", "128",
        "--seq-len", "8192"]


def test_compare_two_ranks_of_a_search_prints_the_sentence_and_the_misses(capsys, llama70b):
    assert main(["compare", *ARGS, "--ranks", "1,3"]) == 0
    out = capsys.readouterr().out
    again = plan("llama3-70b", "dgx-h100", 64, 128, 8192, top_k=3)
    expected = again.plans[0].compare(again.plans[2])
    assert expected.sentence.split(" (")[0] in " ".join(out.split())
    assert "candidates set aside, by reason" in out
    for reason in again.stats.rejected:
        assert reason in out


def test_compare_a_given_layout_against_the_best(capsys):
    code = main(["compare", *ARGS, "-B", "tp=8", "-B", "pp=4", "-B", "vpp=5", "-B", "sequence_parallel=true",
                 "--no-rejected", "--format", "json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["b"]["rank"] == 0 and out["b"]["strategy"]["pp"] == 4
    assert out["rejected"] is None
    c = out["comparison"]
    assert c["sentence"].startswith(("B is", "#1 is"))
    assert sum(d["difference"] for d in c["time"]) == pytest.approx(c["step_time_s_b"] - c["step_time_s_a"])


def test_compare_ranks_of_a_plan_file(tmp_path, capsys):
    assert main(["plan", *ARGS, "--format", "json"]) == 0
    path = tmp_path / "plans.json"
    path.write_text(capsys.readouterr().out)
    assert main(["compare", "--plan", str(path), "--ranks", "2,4", "--format", "csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "kind,term,a,b,difference,share"
    assert any(r.startswith("time_s,compute,") for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "1"], "--ranks must be two different ranks"),
    (["--ranks", "2,2"], "--ranks must be two different ranks"),
    (["-A", "tp=8"], "-A needs -B"),
    (["-B", "tp=3"], "invalid strategy B"),
    (["-B", "tp=4,8"], "must be one value each"),
    (["--ranks", "1,2", "-B", "tp=8"], "use one or the other"),
])
def test_compare_refuses_bad_input_in_one_line(argv, message, capsys):
    assert main(["compare", *ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_compare_needs_a_question_or_a_plan_file(capsys):
    assert main(["compare", "--model", "llama3-70b"]) == 2
    assert "missing option(s)" in capsys.readouterr().err


def test_compare_draws_the_difference(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "c.svg"
    assert main(["compare", *ARGS, "--ranks", "1,2", "--no-rejected", "--plot", str(target)]) == 0
    assert f"plot: {target}" in capsys.readouterr().err
    text = target.read_text()
    assert 'id="diff-compute"' in text and "the difference, term by term" in text
    assert main(["compare", *ARGS, "--plot", str(tmp_path / "c.gif")]) == 2
    assert "must name a .png or .svg file" in capsys.readouterr().err
