"""Published parallel layouts of large runs, given to meshplan as constraints.

    python -m benchmarks.published_layouts             # the table, the notes, and why any layout fails
    python -m benchmarks.published_layouts --details   # also every layout's memory and time breakdown

The layouts live in `benchmarks/data/published_layouts.json`: DeepSeek-V3 as
its technical report trained it, Llama 3.1 405B as Table 4 of the Llama 3
paper ran it (PP 16 interleaved, first and last stage one layer short), and
public MoE recipes for Qwen3-MoE, gpt-oss and Mixtral with their measured
throughput. Each entry states the run as published, the meshplan strategy it
maps to, and the source of every field of that strategy (or that the field
was not published and what was assumed).

Each layout is scored with `planner.evaluate` on the run's own model
architecture (the inline `spec` of the data file, which names its
`config.json`; a shipped preset of the same name is checked to agree with it by
tests/test_published_layouts.py). The table says whether meshplan accepts the
layout (valid), whether it fits in memory, and what it predicts; where a
throughput is published, the prediction's error against it in the published
unit. The published numbers are reported, never fitted: no calibration reads
this file. A layout meshplan rejects or cannot fit is a result, printed with
why (tests/test_published_layouts.py holds the expectations); the exit code is
1 only when evaluate() refused a layout's input, so that nothing was scored.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner import evaluate
from planner.calibrate import run_settings
from planner.errors import SpecError
from planner.specs import ClusterSpec, Estimate, ModelSpec, Strategy
from profiles import load_cluster

DATA = Path(__file__).resolve().parent / "data" / "published_layouts.json"
GIB = 2**30
GB = 1e9

#: Estimate fields a published throughput may be given in, with their table labels.
METRICS = {"tokens_per_s_per_gpu": "tok/s/GPU", "model_tflops_per_gpu": "TFLOP/s/GPU", "mfu": "MFU"}


@dataclass(frozen=True)
class Published:
    """A measured throughput: the Estimate field it compares with, its value, and how it was read."""

    metric: str
    value: float
    how: str


@dataclass(frozen=True)
class PublishedLayout:
    """One published run: model, cluster, job, the meshplan strategy it maps to, and its source."""

    name: str
    model: ModelSpec
    preset: str | None  # the shipped preset that should describe the same model, if any
    cluster: ClusterSpec
    num_gpus: int
    global_batch_size: int
    seq_len: int
    precision: str
    train_options: dict[str, Any]
    strategy: Strategy
    published: Published | None
    source: str
    notes: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class LayoutResult:
    """What meshplan says about one published layout."""

    layout: PublishedLayout
    estimate: Estimate | None
    error: str = ""  # the SpecError message when evaluate() refused the input outright

    @property
    def valid(self) -> bool:
        """No rule rejects the layout (a memory overflow is the only reason allowed)."""
        if self.estimate is None:
            return False
        over = self.estimate.peak_memory_bytes > self.estimate.memory_capacity_bytes
        return len(self.estimate.reasons) == int(over)

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits

    @property
    def finite(self) -> bool:
        e = self.estimate
        return e is not None and all(math.isfinite(v) and v > 0 for v in
                                     (e.step_time_s, e.tokens_per_s_per_gpu, e.mfu, e.peak_memory_bytes))

    @property
    def ok(self) -> bool:
        return self.valid and self.fits and self.finite

    def predicted(self, metric: str) -> float:
        assert self.estimate is not None
        return float(getattr(self.estimate, metric))

    @property
    def relative_error(self) -> float | None:
        """(predicted - published) / published in the published unit; None when nothing is published."""
        p = self.layout.published
        if p is None or self.estimate is None:
            return None
        return self.predicted(p.metric) / p.value - 1.0


def load_data(path: Path = DATA) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"published layouts file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"published layouts file {str(path)!r} is not valid JSON: {exc}") from None


def cluster_for(name: str, clusters: dict[str, Any]) -> ClusterSpec:
    """A shipped cluster preset, or a data-file cluster derived from one: its GPU renamed and its
    NVLink tier's bandwidth replaced (H800 = H100 with NVLink cut), everything else the preset's."""
    entry = clusters.get(name)
    if entry is None:
        return load_cluster(name)
    base = load_cluster(entry["base"])
    gpu = base.gpu.model_copy(update={"name": entry["gpu_name"], "source": entry["source"]})
    intra = base.intra_node.model_copy(update={"bw_bytes_per_s": float(entry["intra_node_bw_gb_per_s"]) * GB})
    return base.model_copy(update={"name": entry["name"], "gpu": gpu, "intra_node": intra, "source": entry["source"]})


def _source_text(src: dict[str, str]) -> str:
    return f"{src['doc']}: {src['where']}"


def load_layouts(path: Path = DATA) -> list[PublishedLayout]:
    """Every layout of the data file, with its model spec, cluster and strategy built and validated."""
    data = load_data(path)
    models: dict[str, Any] = data["models"]
    out = []
    for row in data["layouts"]:
        ref = row["model"]
        if ref in models:
            model, preset = ModelSpec(**models[ref]["spec"]), models[ref].get("preset")
        else:  # a shipped preset (Llama 3.1 405B)
            from profiles import load_model

            model, preset = load_model(ref), ref
        pub = row.get("published")
        out.append(PublishedLayout(
            name=row["name"], model=model, preset=preset, cluster=cluster_for(row["cluster"], data["clusters"]),
            num_gpus=int(row["num_gpus"]), global_batch_size=int(row["global_batch_size"]), seq_len=int(row["seq_len"]),
            precision=row["precision"], train_options=dict(row.get("train_options") or {}),
            strategy=Strategy(**row["strategy"]),
            published=Published(pub["metric"], float(pub["value"]), pub["how"]) if pub else None,
            source=_source_text(row["source"]), notes=tuple(row.get("notes") or ()),
        ))
    return out


def evaluate_layout(layout: PublishedLayout) -> LayoutResult:
    """Score the layout exactly as published; a SpecError (input meshplan refuses to read) is kept, not raised."""
    try:
        est = evaluate(model=layout.model, cluster=layout.cluster, num_gpus=layout.num_gpus,
                       global_batch_size=layout.global_batch_size, seq_len=layout.seq_len,
                       precision=layout.precision, strategy=layout.strategy, **run_settings(layout.train_options))
    except SpecError as exc:
        return LayoutResult(layout, None, str(exc))
    return LayoutResult(layout, est)


def evaluate_all(path: Path = DATA) -> list[LayoutResult]:
    return [evaluate_layout(layout) for layout in load_layouts(path)]


# ---- printing ---------------------------------------------------------------------------------
def _strategy_label(s: Strategy) -> str:
    text = s.short()
    if s.ep > 1 or s.etp > 1:
        text = text.replace(f"pp{s.pp}", f"pp{s.pp} ep{s.ep} etp{s.etp}", 1)
    return text


def _metric(value: float, metric: str) -> str:
    return f"{100 * value:.1f} %" if metric == "mfu" else f"{value:,.0f}"


def table(results: list[LayoutResult]) -> list[str]:
    head = (f"{'layout':30s} {'GPUs':>6s} {'valid':>5s} {'fits':>4s} {'mem/GPU (GiB)':>13s} {'step (s)':>9s} "
            f"{'tok/s/GPU':>9s} {'MFU %':>6s}  {'published':>22s} {'predicted':>10s} {'error':>7s}")
    lines = [head, "-" * len(head)]
    for r in results:
        lay, e = r.layout, r.estimate
        if e is None:
            lines.append(f"{lay.name:30s} {lay.num_gpus:6d} {'no':>5s} {'-':>4s}  refused: {r.error}")
            continue
        pub = pred = err = ""
        if lay.published is not None:
            p = lay.published
            pub = f"{_metric(p.value, p.metric)} {METRICS[p.metric]}"
            pred = _metric(r.predicted(p.metric), p.metric)
            err = f"{r.relative_error:+.1%}"
        lines.append(f"{lay.name:30s} {lay.num_gpus:6d} {'yes' if r.valid else 'no':>5s} "
                     f"{'yes' if r.fits else 'no':>4s} {e.peak_memory_bytes / GIB:13.1f} {e.step_time_s:9.2f} "
                     f"{e.tokens_per_s_per_gpu:9,.0f} {100 * e.mfu:6.1f}  {pub:>22s} {pred:>10s} {err:>7s}")
    return lines


def details(r: LayoutResult) -> list[str]:
    e = r.estimate
    lines = [f"{r.layout.name}: {_strategy_label(r.layout.strategy)}"]
    if e is None:
        return lines + [f"  refused: {r.error}"]
    mem = ", ".join(f"{k} {v / GIB:.2f}" for k, v in e.memory_bytes.items() if v)
    tim = ", ".join(f"{k} {v:.3f}" for k, v in e.time_s.items() if v)
    return lines + [f"  memory (GiB, {e.binding_stage} stage, pipeline rank {e.binding_pipeline_rank}): {mem}",
                    f"  time (s): {tim}; {e.num_microbatches} micro-batches, bubble {e.bubble_fraction:.3f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--details", action="store_true", help="print every layout's memory and time breakdown")
    args = parser.parse_args(argv)
    results = evaluate_all()
    print("Published parallel layouts as meshplan constraints (benchmarks/data/published_layouts.json)")
    print("error = predicted / published - 1, in the published unit; published numbers are reported, never fitted\n")
    for line in table(results):
        print(line)
    print()
    for r in results:
        lay = r.layout
        print(f"{lay.name}: {_strategy_label(lay.strategy)} on {lay.num_gpus} x {lay.cluster.gpu.name}, "
              f"{lay.precision}, GBS {lay.global_batch_size} x {lay.seq_len}")
        print(f"  source: {lay.source}")
        if lay.published is not None:
            print(f"  published: {lay.published.how}")
        for note in lay.notes:
            print(f"  note: {note}")
        if r.estimate is not None and r.estimate.reasons:
            for reason in r.estimate.reasons:
                print(f"  REJECTED: {reason}")
        if args.details or not r.ok:
            for line in details(r)[1:]:
                print(line)
    bad = [r.layout.name for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)} of {len(results)} layouts valid, fitting and predicted"
          + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if any(r.estimate is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
