"""Why one plan beats another: the step-time and memory breakdowns side by side, and the terms that make the
difference in words ("B is 15% slower than A: it loses 11% to the pipeline bubble and 4% to tensor-parallel
communication").

A step is the sum of its exposed time terms (cost_models.step.TIME_TERMS), so the per-term differences add up
to the difference of the steps exactly: each is stated as a share of the faster plan's step, and the term with
the largest loss is the dominant one. Memory is compared on each plan's most-loaded rank (the one that decides
whether it fits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from planner.show.html import html_table, lines_html
from planner.show.labels import GIB, TextTable, memory_word, time_word

if TYPE_CHECKING:
    from planner.specs import Estimate, Strategy

#: A term whose difference is below this share of the faster step is not named in the sentence (it still is
#: in the table): differences this small are inside any model's error.
NAMED_SHARE = 0.005
#: At most this many losing terms (and gaining terms) are named in the sentence.
NAMED_TERMS = 3
#: Steps closer than this (relative) are called equal.
EQUAL_STEPS = 0.001


class TermDifference(BaseModel):
    """One term of the breakdown in both plans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    term: str = Field(description="The term's name, as `explain` prints it (time_s or memory_bytes key).")
    a: float = Field(description="Plan A's value (seconds, or bytes for memory).")
    b: float = Field(description="Plan B's value.")
    difference: float = Field(description="b - a.")
    share: float = Field(description="For time: the difference over the faster plan's step (the slower plan "
                         "loses this share to the term where it is positive). For memory: over plan A's peak.")


class Comparison(BaseModel):
    """Plan B against plan A: the breakdowns side by side and the difference in words (`Plan.compare`,
    `meshplan compare`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    a: str = Field(description="Plan A's label.")
    b: str = Field(description="Plan B's label.")
    step_time_s_a: float
    step_time_s_b: float
    peak_memory_bytes_a: float
    peak_memory_bytes_b: float
    faster: str | None = Field(description="'a' or 'b', None when the steps are within EQUAL_STEPS.")
    slower_by: float = Field(description="The slower step over the faster, minus 1 (0 when equal).")
    time: list[TermDifference] = Field(description="Every step-time term, in the cost model's order.")
    memory: list[TermDifference] = Field(description="Every memory term of the most-loaded rank, largest "
                                         "difference first.")
    dominant_term: str | None = Field(description="The time term the slower plan loses most to (None when equal).")
    bands_overlap: bool | None = Field(None, description="Whether the step-time bands overlap (the model then "
                                       "cannot order the plans); None without bands.")
    sentence: str = Field(description="Why the slower plan is slower, in words.")
    memory_sentence: str = Field(description="How their peak memory differs, in words.")

    def lines(self) -> list[str]:
        """The comparison as text: the two sentences and, where the bands overlap, what that means."""
        out = [self.sentence, self.memory_sentence]
        if self.bands_overlap:
            out.append("their step-time bands overlap: the cost model cannot order them, a short real run "
                       "(`meshplan validate` or `tune`) should")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def time_table(self) -> TextTable:
        """Every step-time term either plan spends time on: both values, the difference, its share; the step last."""
        rows = [[time_word(d.term), f"{d.a:.4f}", f"{d.b:.4f}", f"{d.difference:+.4f}", f"{100 * d.share:+.1f}"]
                for d in self.time if d.a or d.b]
        a, b = self.step_time_s_a, self.step_time_s_b
        rows.append(["step", f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}", f"{100 * (b - a) / min(a, b):+.1f}"])
        return TextTable("step time (exposed seconds per term)",
                         ["term", f"{self.a} (s)", f"{self.b} (s)", f"{self.b} - {self.a} (s)", "% of faster step"],
                         rows, left={"term"})

    def memory_table(self) -> TextTable:
        """Every memory term of the most-loaded rank above 5 MiB in either plan, GiB, with the difference; the peak
        last."""
        rows = [[memory_word(d.term), f"{d.a / GIB:.2f}", f"{d.b / GIB:.2f}", f"{d.difference / GIB:+.2f}"]
                for d in self.memory if max(abs(d.a), abs(d.b)) >= 0.005 * GIB]
        a, b = self.peak_memory_bytes_a, self.peak_memory_bytes_b
        rows.append(["peak", f"{a / GIB:.2f}", f"{b / GIB:.2f}", f"{(b - a) / GIB:+.2f}"])
        return TextTable("memory of the most-loaded rank (GiB)", ["term", self.a, self.b, f"{self.b} - {self.a}"],
                         rows, left={"term"})

    def _repr_html_(self) -> str:
        """The sentences and both breakdowns side by side, as a notebook shows a comparison."""
        return lines_html(self.lines()) + html_table(self.time_table()) + html_table(self.memory_table())


def _pct(x: float) -> str:
    """11% / 0.6% : a share as a sentence states it."""
    return f"{100 * x:.0f}%" if abs(x) >= 0.095 else f"{100 * x:.1f}%"


def _why(term: str, sa: "Strategy | None", sb: "Strategy | None", ea: "Estimate", eb: "Estimate", slow: str) -> str:
    """A short reason beside a term, from the two layouts (empty where the term needs none)."""
    if sa is None or sb is None:
        return ""
    s_slow, s_fast = (sb, sa) if slow == "b" else (sa, sb)
    e_slow, e_fast = (eb, ea) if slow == "b" else (ea, eb)
    if term == "pp_bubble":
        return (f" (pp {s_slow.pp} vs {s_fast.pp}, bubble {_pct(e_slow.bubble_fraction)} vs "
                f"{_pct(e_fast.bubble_fraction)} of compute)")
    if term in ("tp_comm", "cp_comm", "ep_comm", "dp_comm"):
        dim = term.split("_")[0]
        size = {"tp": lambda s: s.tp, "cp": lambda s: s.cp, "ep": lambda s: s.ep, "dp": lambda s: s.dp * s.cp}[dim]
        name = "dp·cp" if dim == "dp" and max(s_slow.cp, s_fast.cp) > 1 else dim
        group = {g.dim: g for g in e_slow.groups}.get(dim)
        cross = f" over {group.tier}" if group is not None and group.level else ""
        return f" ({name} {size(s_slow)}{cross} vs {size(s_fast)})"
    if term == "recompute":
        return f" (recompute {s_slow.recompute} vs {s_fast.recompute})"
    return ""


def compare_estimates(ea: "Estimate", eb: "Estimate", a: str = "A", b: str = "B", sa: "Strategy | None" = None,
                      sb: "Strategy | None" = None) -> Comparison:
    """Plan B (`eb`, layout `sb`) against plan A: every term side by side, and the sentence naming what the
    slower one loses to. The per-term differences sum to the step difference (a step is its terms' sum)."""
    step_a, step_b = ea.step_time_s, eb.step_time_s
    fast = min(step_a, step_b)
    terms = list(ea.time_s) + [t for t in eb.time_s if t not in ea.time_s]
    time = [TermDifference(term=t, a=ea.time_s.get(t, 0.0), b=eb.time_s.get(t, 0.0),
                           difference=eb.time_s.get(t, 0.0) - ea.time_s.get(t, 0.0),
                           share=(eb.time_s.get(t, 0.0) - ea.time_s.get(t, 0.0)) / fast) for t in terms]
    mterms = list(ea.memory_bytes) + [t for t in eb.memory_bytes if t not in ea.memory_bytes]
    memory = sorted((TermDifference(term=t, a=ea.memory_bytes.get(t, 0.0), b=eb.memory_bytes.get(t, 0.0),
                                    difference=eb.memory_bytes.get(t, 0.0) - ea.memory_bytes.get(t, 0.0),
                                    share=(eb.memory_bytes.get(t, 0.0) - ea.memory_bytes.get(t, 0.0))
                                    / ea.peak_memory_bytes) for t in mterms),
                    key=lambda d: -abs(d.difference))
    gap = abs(step_b - step_a) / fast
    if gap < EQUAL_STEPS:
        faster, dominant = None, None
        sentence = (f"{a} and {b} are predicted equally fast ({step_a:.3f} s and {step_b:.3f} s per step, within "
                    f"{_pct(EQUAL_STEPS)})")
    else:
        faster = "a" if step_a < step_b else "b"
        slow_name, fast_name = (b, a) if faster == "a" else (a, b)
        sign = 1.0 if faster == "a" else -1.0  # the slower plan's loss per term, positive where it loses
        losses = sorted(((sign * d.share, d.term) for d in time), reverse=True)
        dominant = losses[0][1]
        lost = [(x, t) for x, t in losses if x >= NAMED_SHARE][:NAMED_TERMS] or losses[:1]
        gained = [(x, t) for x, t in sorted(losses) if x <= -NAMED_SHARE][:NAMED_TERMS]
        slow = "b" if faster == "a" else "a"
        parts = [f"{_pct(x)} to {time_word(t)}{_why(t, sa, sb, ea, eb, slow)}" for x, t in lost]
        sentence = (f"{slow_name} is {_pct(gap)} slower than {fast_name} ({max(step_a, step_b):.3f} s vs "
                    f"{fast:.3f} s per step): it loses " + _join(parts))
        if gained:
            sentence += ", and gains back " + _join([f"{_pct(-x)} on {time_word(t)}" for x, t in gained])
    dm = eb.peak_memory_bytes - ea.peak_memory_bytes
    if abs(dm) < 0.05 * GIB:
        memory_sentence = f"{a} and {b} peak at the same memory ({ea.peak_memory_bytes / GIB:.1f} GiB per GPU)"
    else:
        more, less = (b, a) if dm > 0 else (a, b)
        sign = 1.0 if dm > 0 else -1.0
        named = [d for d in memory if sign * d.difference >= 0.05 * GIB][:NAMED_TERMS]
        memory_sentence = (f"{more} needs {abs(dm) / GIB:.1f} GiB more per GPU than {less} "
                           f"({max(ea.peak_memory_bytes, eb.peak_memory_bytes) / GIB:.1f} vs "
                           f"{min(ea.peak_memory_bytes, eb.peak_memory_bytes) / GIB:.1f} GiB on its most-loaded "
                           "rank)" + (": " + _join([f"{sign * d.difference / GIB:+.1f} GiB {memory_word(d.term)}"
                                                   for d in named]) if named else ""))
    overlap = None
    if None not in (ea.step_time_s_low, eb.step_time_s_low):
        overlap = bool(ea.step_time_s_low <= eb.step_time_s_high and eb.step_time_s_low <= ea.step_time_s_high)
    return Comparison(a=a, b=b, step_time_s_a=step_a, step_time_s_b=step_b, peak_memory_bytes_a=ea.peak_memory_bytes,
                      peak_memory_bytes_b=eb.peak_memory_bytes, faster=faster,
                      slower_by=0.0 if faster is None else gap, time=time, memory=memory, dominant_term=dominant,
                      bands_overlap=overlap, sentence=sentence, memory_sentence=memory_sentence)


def _join(parts: list[str]) -> str:
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]
