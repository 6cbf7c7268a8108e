"""The pictures (planner.show.plots): each is saved as SVG and read back, and what it draws is counted against
the data it was drawn from (points, bars, schedule blocks, the bubble, the axis words); PNGs are checked as PNG."""

from __future__ import annotations

import re
import struct
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from executors.compare import PlanComparison, ValidationReport  # noqa: E402
from executors.tune.tuner import TrialRecord, TuneReport  # noqa: E402
from planner import PlanResult, plan  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from planner.show import plots  # noqa: E402
from planner.show.labels import MEMORY_TERM_WORDS, TIME_TERM_WORDS, plan_label  # noqa: E402

QUESTION = dict(model="llama3-8b", cluster="dgx-h100", num_gpus=8, global_batch_size=32, seq_len=4096)
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def result():
    """A small search: a few hundred fitting candidates, drawn as points (not rasterised)."""
    r = plan(**QUESTION, top_k=4, constraints={"pp": [1, 2, 4], "tp": [1, 2], "zero_stage": 1, "recompute": "none"})
    assert 0 < r.candidates.fits.sum() <= plots.RASTER_POINTS
    return r


@pytest.fixture(scope="module")
def piped():
    """Ranked plans on 4 pipeline stages with 2 chunks each (interleaved 1F1B)."""
    r = plan(**QUESTION, top_k=2, constraints={"pp": 4, "vpp": 2, "tp": 2, "zero_stage": 1, "recompute": "none"})
    assert r.plans and len(r.plans[0].estimate.stages) == 4
    return r


def svg(fig) -> ET.Element:
    return ET.fromstring(plots.figure_bytes(fig, ".svg"))


def by_id(root: ET.Element) -> dict[str, ET.Element]:
    return {e.get("id"): e for e in root.iter() if e.get("id")}


def uses(group: ET.Element) -> int:
    return sum(1 for _ in group.iter(SVG + "use"))


def text(root: ET.Element) -> str:
    return "\n".join("".join(t.itertext()) for t in root.iter(SVG + "text"))


def box(group: ET.Element) -> tuple[float, float, float, float]:
    """x0, x1, y0, y1 of the rectangle path in a bar's or block's group."""
    d = next(group.iter(SVG + "path")).get("d")
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", d)]
    xs, ys = nums[0::2], nums[1::2]
    return min(xs), max(xs), min(ys), max(ys)


def test_pareto_draws_every_fitting_candidate_the_front_the_limits_and_the_plans(result, tmp_path):
    c = result.candidates
    fig = result.plot_pareto(path=tmp_path / "p.svg")
    root = ET.parse(tmp_path / "p.svg").getroot()
    ids = by_id(root)
    assert uses(ids["candidates"]) == int(c.fits.sum())
    assert uses(ids["pareto-front"]) == len(c.pareto())
    assert uses(ids["plans"]) == len(result.plans)
    assert {"memory-limit", "memory-capacity"} <= set(ids)
    words = text(root)
    for label in ("peak memory per GPU (GiB)", "tokens/s per GPU", result.model.name, result.cluster.name,
                  f"limit {c.memory_limit_bytes / 2**30:.1f} GiB", f"{int(c.fits.sum()):,} fitting candidates"):
        assert label in words
    assert {f"plan-number-{p.rank}" for p in result.plans} <= set(ids)
    assert fig.axes[0].get_xlabel() == "peak memory per GPU (GiB)"


def test_pareto_rasterises_many_points(result, monkeypatch):
    monkeypatch.setattr(plots, "RASTER_POINTS", 10)
    root = svg(result.plot_pareto())
    assert "candidates" not in by_id(root)  # one raster image, which keeps no id
    assert sum(1 for _ in root.iter(SVG + "image")) == 1
    assert uses(by_id(root)["pareto-front"]) == len(result.candidates.pareto())  # the front stays vector


def test_breakdown_has_one_bar_per_plan_and_nonzero_term(result):
    plans = result.plans[:3]
    root = svg(result.plot_breakdown(top=3))
    bars = {i for i in by_id(root) if i.startswith("bar-")}
    terms = [t for t in plans[0].estimate.time_s if any(p.estimate.time_s.get(t, 0.0) for p in plans)]
    assert bars == {f"bar-{t}-{p.rank}" for t in terms for p in plans}
    zero = [t for t in plans[0].estimate.time_s if t not in terms]
    assert "pp_bubble" in zero  # these plans have one stage: no bubble bar, no bubble in the legend
    words = text(root)
    assert all(TIME_TERM_WORDS[t] in words for t in terms)
    assert TIME_TERM_WORDS["pp_bubble"] not in words
    assert "exposed step time (s)" in words and plan_label(plans[0])[:40] in words
    # the stacked bars add up to each plan's step
    ids = by_id(root)
    width = {p.rank: sum(box(ids[f"bar-{t}-{p.rank}"])[1] - box(ids[f"bar-{t}-{p.rank}"])[0] for t in terms)
             for p in plans}
    for p in plans:
        assert width[p.rank] / width[plans[0].rank] == pytest.approx(
            p.estimate.step_time_s / plans[0].estimate.step_time_s, rel=1e-3)


def test_memory_per_stage_stacks_each_ranks_terms(piped):
    p = piped.plans[0]
    root = svg(piped.plot_memory(rank=1))
    ids = by_id(root)
    stages = p.estimate.stages
    terms = [t for t in stages[0].memory_bytes if any(s.memory_bytes.get(t) for s in stages)]
    assert {i for i in ids if i.startswith("mem-")} == {f"mem-{t}-r{s.pipeline_rank}" for t in terms for s in stages}
    heights = [sum(box(ids[f"mem-{t}-r{s.pipeline_rank}"])[3] - box(ids[f"mem-{t}-r{s.pipeline_rank}"])[2]
                   for t in terms) for s in stages]
    for s, h in zip(stages, heights):
        assert h / heights[0] == pytest.approx(s.peak_memory_bytes / stages[0].peak_memory_bytes, rel=1e-3)
    assert {"memory-limit", "memory-capacity"} <= set(ids)
    words = text(root)
    assert "pipeline rank" in words and "memory per GPU (GiB)" in words
    assert all(MEMORY_TERM_WORDS.get(t, t) in words for t in terms if t in MEMORY_TERM_WORDS)


def test_memory_without_stages_draws_the_binding_rank_and_says_so(piped):
    p = piped.plans[0]
    bare = p.model_copy(update={"estimate": p.estimate.model_copy(update={"stages": []})})
    root = svg(bare.plot_memory())
    assert {i.rsplit("-", 1)[1] for i in by_id(root) if i.startswith("mem-")} == {
        f"r{p.estimate.binding_pipeline_rank}"}
    assert "the most loaded, alone" in text(root)


def test_schedule_draws_every_block_and_the_bubble(piped):
    p = piped.plans[0]
    s, e = p.strategy, p.estimate
    sched, own = plots.simulated(s, e)
    assert own
    root = svg(p.plot_schedule())
    ids = by_id(root)
    blocks = [i for i in ids if i.startswith("block-")]
    assert len(blocks) == 2 * s.pp * e.num_microbatches * s.vpp
    assert f"block-F-r0-m{e.num_microbatches - 1}-c{s.vpp - 1}" in ids
    row = box(ids["row-r0"])
    busy = sum(box(ids[i])[1] - box(ids[i])[0] for i in blocks if i.startswith(("block-F-r0-", "block-B-r0-")))
    idle_drawn = 1 - busy / (row[1] - row[0])
    assert idle_drawn == pytest.approx(sched.idle_s[0] / sched.makespan_s, abs=1e-3)
    assert idle_drawn > 0.01  # a pipeline of 4 stages idles: the bubble is visible
    words = text(root)
    assert f"simulated bubble {100 * sched.bubble_fraction:.1f}%" in words
    assert f"pp {s.pp}, vpp {s.vpp}, m {e.num_microbatches}" in words and "interleaved 1F1B" in words


def test_schedule_of_the_first_microbatches_only(piped):
    p = piped.plans[0]
    root = svg(p.plot_schedule(max_microbatches=4))
    ids = by_id(root)
    assert f"first 4 of {p.estimate.num_microbatches} micro-batches' time shown" in text(root)
    drawn = {int(i.split("-m")[1].split("-")[0]) for i in ids if i.startswith("block-B-r0-")}
    assert max(drawn) == 3  # rank 0's last drawn backward is micro-batch 3's
    with pytest.raises(SpecError, match="max_microbatches"):
        p.plot_schedule(max_microbatches=0)


def test_schedule_of_one_stage_is_one_row_without_bubble(result):
    p = result.plans[0]
    assert p.strategy.pp == 1
    ids = by_id(svg(result.plot_schedule(rank=1)))
    assert {i for i in ids if i.startswith("row-")} == {"row-r0"}
    busy = sum(box(ids[i])[1] - box(ids[i])[0] for i in ids if i.startswith("block-"))
    row = box(ids["row-r0"])
    assert busy == pytest.approx(row[1] - row[0], rel=1e-4)
    assert len([i for i in ids if i.startswith("block-")]) == 2 * p.estimate.num_microbatches


def test_png_is_a_png_of_the_figures_size(result, tmp_path):
    fig = result.plot_breakdown(path=tmp_path / "b.png")
    data = (tmp_path / "b.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == tuple(round(v * plots.DPI) for v in fig.get_size_inches())


def test_bad_inputs_are_one_line_errors(result, tmp_path):
    with pytest.raises(SpecError, match=r"must name a \.png or \.svg file"):
        result.plot_breakdown(path=tmp_path / "b.pdf")
    with pytest.raises(SpecError, match="folder .* does not exist"):
        result.plot_breakdown(path=tmp_path / "nowhere" / "b.png")
    with pytest.raises(SpecError, match=r"rank \(9\) names no plan: the ranked plans have ranks 1, 2, 3, 4"):
        result.plot_memory(rank=9)
    with pytest.raises(SpecError, match="top"):
        result.plot_breakdown(top=0)
    read_back = PlanResult.model_validate_json(result.model_dump_json())
    with pytest.raises(SpecError, match="holds no candidate table"):
        read_back.plot_pareto()
    assert by_id(svg(read_back.plot_breakdown()))  # the rest draws from the plans the file keeps


def test_missing_matplotlib_says_what_to_install(result, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SpecError, match=r"meshplan\[plot\]"):
        result.plot_breakdown()


def test_predicted_vs_measured_of_validate_and_tune(result):
    st = result.plans[0].strategy
    comps = [PlanComparison(label="a", strategy=st, outcome="ok", predicted_step_time_s=1.0, measured_step_time_s=1.2),
             PlanComparison(label="b", strategy=st, outcome="ok", predicted_step_time_s=2.0, measured_step_time_s=1.8),
             PlanComparison(label="c", strategy=st, outcome="oom", predicted_step_time_s=2.0)]
    report = ValidationReport(model=result.model, cluster="dgx-h100", train=result.train, num_gpus=8, device="cpu",
                              engine="torch", comparisons=comps)
    root = svg(report.plot())
    ids = by_id(root)
    assert uses(ids["pairs"]) == 2 and "identity" in ids
    assert "measured step time (s)" in text(root) and "predicted step time (s)" in text(root)
    trials = [TrialRecord(number=0, state="COMPLETE", label="t0", predicted_step_s=1.0, predicted_step_s_low=0.8,
                          predicted_step_s_high=1.3, measured_step_s=1.1),
              TrialRecord(number=1, state="COMPLETE", label="t1", predicted_step_s=0.5, measured_step_s=0.7),
              TrialRecord(number=2, state="FAIL", label="t2", predicted_step_s=0.5)]
    tuned = TuneReport(study_name="s", storage="sqlite:///x.db", job={}, trials=trials, best=None, measured=2,
                       stopped="done")
    ids = by_id(svg(tuned.plot()))
    assert uses(ids["pairs"]) == 2 and "pair-bands" in ids
    ids = by_id(svg(plots.predicted_vs_measured([("x", 1.0, 1.1)], band=0.1)))
    assert "band" in ids
    with pytest.raises(SpecError, match="nothing to plot"):
        plots.predicted_vs_measured([("x", None, 1.0)])


def test_comparison_stacks_both_plans(piped, result):
    a, b = result.plans[0], piped.plans[0]
    comp = a.compare(b)
    ids = by_id(svg(plots.comparison(comp, a.estimate, b.estimate)))
    for d in comp.time:
        if d.a or d.b:
            assert {f"bar-{d.term}-a", f"bar-{d.term}-b"} <= set(ids)
    assert {f"mem-{d.term}-a" for d in comp.memory if d.a or d.b} <= set(ids)
    # the difference panel: one bar per term either plan spends time on, each as long as its share
    fig = plots.comparison(comp, a.estimate, b.estimate)
    bars = {p.get_gid(): p.get_width() for ax in fig.axes for p in ax.patches if str(p.get_gid()).startswith("diff-")}
    assert bars == pytest.approx({f"diff-{d.term}": 100 * d.share for d in comp.time if d.a or d.b})


def test_plan_and_explain_figures(result, piped):
    ids = by_id(svg(plots.plan_figure(result)))
    assert "candidates" in ids and f"bar-compute-{result.plans[0].rank}" in ids
    p = piped.plans[0]
    ids = by_id(svg(plots.explain_figure(p.strategy, p.estimate, headroom=0.05)))
    assert "row-r3" in ids and "mem-params-r3" in ids and "memory-limit" in ids


def test_nothing_fits_draws_the_closest_memory_against_the_limit():
    r = plan(model="llama3.1-405b", cluster="dgx-a100-40gb", num_gpus=8, global_batch_size=8, seq_len=8192,
             top_k=3)
    assert not r.plans and r.closest
    root = svg(plots.plan_figure(r))
    ids = by_id(root)
    assert {i.rsplit("-", 1)[1] for i in ids if i.startswith("mem-params-")} == {str(p.rank) for p in r.closest}
    assert "no strategy fits" in text(root) and "memory-limit" in ids
