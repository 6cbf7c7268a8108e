"""The HTML report (planner.report, `meshplan report`): what it holds, that it escapes what the input names, where
it may be written, and, in a real headless chromium (tests/browser.py), that it loads with no console error and
shows its table and pictures; the screenshot is kept under build/test-artefacts/."""

from __future__ import annotations

import html
import json
import os
import re
import struct

import pytest

from browser import artefact_path
from planner import plan
from planner.cli import main
from planner.errors import SpecError
from planner.report import build_report, check_report_target, report_figures, write_report
from planner.show.compare import Comparison
from planner.specs import PlanResult

QUESTION = ("llama3-70b", "dgx-h100", 64, 128, 8192)
ARGS = ["--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch-size", "128",
        "--seq-len", "8192"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result() -> PlanResult:
    return plan(*QUESTION, top_k=6)


def _rows(page_html: str, table_id: str) -> list[str]:
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', page_html, re.S)
    assert body, table_id
    return re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.S)


def test_the_page_holds_the_table_the_winner_and_the_misses(result):
    page = build_report(result, configs=False)
    assert page.startswith("<!doctype html>")
    assert len(_rows(page, "plan-table")) == len(result.plans)
    best = result.plans[0]
    assert f"{best.estimate.step_time_s:.3f}" in _rows(page, "plan-table")[0]
    # the sentence is Plan.compare's, verbatim (escaped)
    c: Comparison = best.compare(result.plans[1])
    assert html.escape(c.sentence) in page
    # every reason the search set candidates aside for has its row
    rejected = _rows(page, "rejected-table")
    assert len(rejected) == len(result.stats.rejected)
    for reason in result.stats.rejected:
        assert html.escape(reason) in page
    # self-contained: no script, no link out
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page


def test_the_configs_are_the_emitters_own(result):
    from planner.emit import emit

    page = build_report(result, configs=True)
    text = emit(result.plans[0], "megatron")
    assert html.escape(text) in page


def test_names_from_the_input_are_escaped():
    spec = {"name": "<img src=x onerror=alert(1)>", "num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
            "ffn_hidden_size": 4096, "vocab_size": 32000, "max_position_embeddings": 2048}
    r = plan(spec, "dgx-h100", 8, 16, 2048, top_k=2)
    page = build_report(r, configs=False)
    assert "<img src=x" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


def test_a_result_from_a_file_says_what_it_cannot_show(result):
    again = PlanResult.model_validate(json.loads(result.model_dump_json()))
    page = build_report(again, configs=False)
    assert "keeps no candidate table" in page
    figures, notes = report_figures(again)
    assert "fig-pareto" not in [f.id for f in figures]
    assert any("candidate table" in n for n in notes)


def test_nothing_fits_is_refused():
    r = plan("gpt3-175b", "dgx-h100", 8, 8, 2048, top_k=1)
    assert not r.plans
    with pytest.raises(SpecError, match="needs at least one plan that fits"):
        build_report(r)


@pytest.mark.parametrize("name, message", [("report.txt", "must name an .html file"),
                                           ("missing/report.html", "does not exist"),
                                           ("folder.html", "is a directory")])
def test_the_target_is_checked(tmp_path, name, message):
    (tmp_path / "folder.html").mkdir()
    with pytest.raises(SpecError, match=message):
        check_report_target(tmp_path / name)


def test_a_link_is_never_followed(tmp_path, result):
    victim = tmp_path / "victim.html"
    victim.write_text("keep")
    link = tmp_path / "report.html"
    os.symlink(victim, link)
    with pytest.raises(SpecError, match="symbolic link"):
        write_report(result, link, configs=False)
    assert victim.read_text() == "keep"


def test_the_command_checks_its_target_before_the_search(tmp_path, capsys):
    assert main(["report", *ARGS, "--out", str(tmp_path / "r.pdf")]) == 2
    assert "must name an .html file" in capsys.readouterr().err


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.browser
@pytest.mark.slow
def test_the_report_renders_in_a_real_browser(tmp_path, browser_page, request, capsys):
    """`meshplan report` from a fresh search, opened in headless chromium: no console error, the table, every
    picture and the sentence visible; a screenshot kept as an artefact."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.html"
    assert main(["report", *ARGS, "--top", "6", "--out", str(out)]) == 0
    assert f"report: {out}" in capsys.readouterr().err
    browser_page.open(out)
    assert browser_page.errors == []
    cells = browser_page.visible("#plan-table tbody tr")
    assert len(cells) == 6 and all(c["visible"] for c in cells)
    images = browser_page.visible("figure img")
    ids = browser_page.evaluate("[...document.querySelectorAll('figure')].map(f => f.id)")
    assert ids == ["fig-pareto", "fig-breakdown", "fig-memory", "fig-schedule"]
    for image in images:
        assert image["visible"] and image["complete"] and image["natural_width"] > 100 and image["height"] > 50
    sentence = browser_page.visible("p.sentence")
    assert sentence and sentence[0]["visible"]
    assert browser_page.visible("#rejected-table")[0]["visible"]
    assert browser_page.visible("#configs pre")[0]["visible"]
    shot = browser_page.screenshot(artefact_path(request, "-report.png"))
    width, height = _png_size(shot.read_bytes())
    assert width > 500 and height > 1000  # the whole page, not the window


def test_a_notebook_shows_a_result_and_a_comparison_as_the_cli_does(result):
    from planner.show.labels import plan_table

    shown = result._repr_html_()
    cells = plan_table(result, wide=True)
    assert len(re.findall(r"<tr>", shown)) == len(cells.rows) + 1  # the header row and one per plan
    for row in cells.rows:
        assert "".join(f"<td{'' if c in cells.left else ' class=num'}>{html.escape(v)}</td>"
                       for c, v in zip(cells.columns, row)) in shown
    c = result.plans[0].compare(result.plans[1])
    assert html.escape(c.sentence) in c._repr_html_()


def test_every_framework_gets_a_config_and_says_how_it_was_planned(result):
    from planner.emit import bridge_overrides

    page = build_report(result, configs=True)
    configs = page.split('<section id="configs">')[1]
    # Megatron-Bridge's recipe reduces gradients in fp32: the plans chosen with bf16 reduction cannot be written
    # for it, so it gets plans searched again with its settings, and says so
    assert result.plans[0].train.grad_precision == "bf16"
    assert "megatron-bridge: searched again with the settings its config imposes (grad_precision fp32)" in configs
    bridge = configs.split("megatron-bridge:")[1].split("<h3>")[0]
    again = plan(*QUESTION, top_k=6, grad_precision="fp32")
    assert html.escape(bridge_overrides(again.plans[0])[0]) in bridge
    # a plan ranked as Megatron runs it, written for DeepSpeed: said next to the config
    deepspeed = configs.split("<h3>deepspeed:")[1].split("<h3>")[0]
    assert "was costed and ranked as megatron runs it, not deepspeed" in deepspeed


def test_validation_and_tune_reports_show_the_cli_cells_in_a_notebook():
    """The tables `validate` and `tune` print come from planner.show.labels; their reports show the same cells."""
    from types import SimpleNamespace as NS

    from planner.show.html import html_table
    from planner.show.labels import trials_table, validation_table

    comp = NS(label="dp2 tp1 pp1", outcome="ok", reason="", predicted_step_time_s=0.5, measured_step_time_s=0.4,
              step_time_error=0.25, predicted_memory_bytes=3 * 2**20, measured_memory_bytes=2 * 2**20,
              memory_error=0.5, predicted_rank=1, measured_rank=1, parity=NS(passed=True), host_load=None, busy=False)
    report = NS(model=NS(name="<tiny>"), num_gpus=2, cluster="local-cpu", device="cpu", engine="torch",
                train=NS(global_batch_size=4, seq_len=32, precision="fp32"), comparisons=[comp])
    cells = validation_table(report)
    assert cells.rows == [["1", "dp2 tp1 pp1", "ok", "0.500", "0.400", "+25", "3", "2", "+50", "1", "1", "pass", "-"]]
    assert "&lt;tiny&gt;" in html_table(cells)
    trial = NS(number=3, label="dp2", origin="plan #1", state="COMPLETE", status="ok", busy=False,
               predicted_step_s=0.5, measured_step_s=0.4, error=0.25, error_calibrated=None, spread=0.1,
               predicted_peak_memory_bytes=None, measured_peak_memory_bytes=2 * 2**20, tokens_per_s=320.0)
    queued = NS(number=4, state="WAITING", status="")
    tune = NS(study_name="s", measured=1, job=dict(model="m", num_gpus=2, cluster="c", global_batch_size=4, seq_len=32,
                                                   precision="fp32"), trials=[trial, queued])
    assert trials_table(tune).rows == [["3", "dp2", "plan #1", "ok", "0.500", "0.400", "+25%", "-", "10%", "-", "2",
                                        "320"]]
