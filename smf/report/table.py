"""Table 1: mean ± std over seeds per condition, as Markdown, LaTeX and CSV.

A result record is one finished run: ``{"condition": one of CONDITIONS, "seed": int,
"medmcqa_acc": float, "wikitext_ppl": float, "triviaqa_acc": float}`` (own data: ``learn_acc``,
``heldout_ppl``, ``retain_acc``, docs/own-data.md); a metric may be missing or None (not evaluated); a run of a suite's
``variants`` also holds ``"variant"``, and each (condition, variant) is a row of its own.
``labels`` (metric key -> title) retitle the columns. The spread is the SAMPLE standard deviation over the seeds that
measured the metric (n - 1 in the denominator), 0 for a single seed; "Seeds" counts runs. In
every column the best mean (highest accuracy, lowest perplexity) is bold; ties for best are all
bold, but a column whose values all tie has no bold. ``model`` names the base row after the model
used (:func:`smf.report.paper_results.display_name`). With ``include_paper`` the paper's numbers
(docs/method.md#paper-results)
stand beside ours, column by column; use it when the runs used the paper's model.
"""
from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from smf.report.paper_results import (DISPLAY_NAMES, HIGHER_IS_BETTER, METRICS, PAPER_TABLE1, display_name,
                                      metric_keys, metric_title)
from smf.vocabulary import CONDITIONS


@dataclass(frozen=True)
class Summary:
    """One condition's results: ``stats[metric]`` is (mean, std) over seeds (std None from one seed: no spread), or
    None if never measured; ``variant``: the suite variant the runs share (None: none)."""

    condition: str
    n_seeds: int
    stats: dict[str, tuple[float, float] | None]
    variant: str | None = None


def summarize(records: Sequence[dict]) -> list[Summary]:
    """Group run records by condition (in the paper's order; each condition's variants in the order they first
    appear) and reduce each metric (:func:`metric_keys`) to mean ± sample std."""
    metrics = metric_keys(records)
    by_condition: dict[tuple[str, str | None], dict[int, dict]] = {}
    for record in records:
        condition, seed, variant = record.get("condition"), record.get("seed"), record.get("variant")
        if condition not in DISPLAY_NAMES:
            raise ValueError(f"record condition must be one of {list(CONDITIONS)}, got {condition!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"record seed must be an int, got {seed!r} (condition {condition})")
        if seed in by_condition.setdefault((condition, variant), {}):
            where = condition if variant is None else f"{condition} [{variant}]"
            raise ValueError(f"two records for condition {where!r} with seed {seed}")
        for metric in metrics:
            value = record.get(metric)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"record {metric} must be a finite number or None, got {value!r}")
        by_condition[(condition, variant)][seed] = record
    summaries = []
    for (condition, variant), by_seed in sorted(by_condition.items(), key=lambda item: CONDITIONS.index(item[0][0])):
        runs = by_seed.values()
        stats = {}
        for metric in metrics:
            values = [float(run[metric]) for run in runs if run.get(metric) is not None]
            stats[metric] = ((statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None)
                             if values else None)
        summaries.append(Summary(condition, len(runs), stats, variant))
    return summaries


def paper_summaries(conditions: Sequence[str] = CONDITIONS) -> list[Summary]:
    """The paper's Table 1 rows as summaries (seed counts are not reported: n_seeds = 0)."""
    return [Summary(condition, 0, dict(PAPER_TABLE1[condition])) for condition in conditions]


def _columns(summaries: Sequence[Summary], include_paper: bool) -> list[tuple[str, str, list]]:
    """(source, metric, one (mean, std) | None per row) for every numeric column, in display order."""
    if include_paper and summaries and tuple(summaries[0].stats) != METRICS:
        raise ValueError("include_paper needs the paper's metrics; these records hold own-data metrics")
    columns = []
    for metric in (summaries[0].stats if summaries else METRICS):
        columns.append(("ours", metric, [summary.stats[metric] for summary in summaries]))
        if include_paper:
            columns.append(("paper", metric, [PAPER_TABLE1[summary.condition][metric] for summary in summaries]))
    return columns


def _best_rows(cells: Sequence[tuple[float, float] | None], metric: str) -> set[int]:
    means = [cell[0] for cell in cells if cell is not None]
    if len(set(means)) < 2:  # nothing measured, or every value ties: no best to mark
        return set()
    best = max(means) if HIGHER_IS_BETTER[metric] else min(means)
    return {row for row, cell in enumerate(cells) if cell is not None and cell[0] == best}


def _header(source: str, metric: str, up: str, down: str, labels: dict | None) -> str:
    arrow = up if HIGHER_IS_BETTER[metric] else down
    return f"{metric_title(metric, labels)} {arrow}" + (" (paper)" if source == "paper" else "")


def stat_text(cell: tuple[float, float | None], plus_minus: str = " ± ", bold=str) -> str:
    """``mean ± spread`` to 3 decimals (``bold`` applied to the mean); the mean alone when the spread is None (one
    seed: no interval to show)."""
    mean = bold(f"{cell[0]:.3f}")
    return mean if cell[1] is None else f"{mean}{plus_minus}{cell[1]:.3f}"


def _formatted_grid(summaries, include_paper, bold, plus_minus, up, down, missing, model, labels=None):
    """Header row and body rows of display strings, shared by Markdown and LaTeX."""
    columns = _columns(summaries, include_paper)
    header = ["Method", *(_header(source, metric, up, down, labels) for source, metric, _ in columns), "Seeds"]
    body = [[display_name(summary.condition, model, summary.variant)] for summary in summaries]
    for _, metric, cells in columns:
        best = _best_rows(cells, metric)
        for row, cell in enumerate(cells):
            if cell is None:
                body[row].append(missing)
                continue
            body[row].append(stat_text(cell, plus_minus, bold if row in best else str))
    for row, summary in enumerate(summaries):
        body[row].append(str(summary.n_seeds))
    return header, body


def to_markdown(summaries: Sequence[Summary], *, include_paper: bool = False, model: str | None = None,
                labels: dict[str, str] | None = None) -> str:
    """GitHub-flavoured Markdown table; bold as ``**mean**``."""
    header, body = _formatted_grid(summaries, include_paper, lambda text: f"**{text}**", " ± ", "↑", "↓", "—",
                                   model, labels)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_latex(summaries: Sequence[Summary], *, include_paper: bool = False, model: str | None = None,
             labels: dict[str, str] | None = None) -> str:
    """A booktabs ``tabular`` like the paper's Table 1; bold as ``\\textbf{mean}``."""
    header, body = _formatted_grid(summaries, include_paper, lambda text: f"\\textbf{{{text}}}", " $\\pm$ ",
                                   "$\\uparrow$", "$\\downarrow$", "--", model, labels)
    escape = lambda text: text.replace("&", "\\&").replace("%", "\\%").replace("_", "\\_")  # noqa: E731
    lines = ["\\begin{tabular}{l" + "c" * (len(header) - 1) + "}", "\\toprule",
             " & ".join(escape(title) for title in header) + " \\\\", "\\midrule"]
    lines += [" & ".join([escape(row[0]), *row[1:]]) + " \\\\" for row in body]
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def to_csv(summaries: Sequence[Summary], *, include_paper: bool = False, model: str | None = None,
           labels: dict[str, str] | None = None) -> str:
    """Machine-readable CSV: condition, (variant, when a row has one,) method, seeds, then ``{metric}_mean`` /
    ``{metric}_std`` (and ``paper_{metric}_mean`` / ``paper_{metric}_std``) at full precision; empty when missing. The
    columns are named by metric key, so ``labels`` (accepted like the other formats') does not change them."""
    columns = _columns(summaries, include_paper)
    names = [f"{'paper_' if source == 'paper' else ''}{metric}" for source, metric, _ in columns]
    variants = any(summary.variant is not None for summary in summaries)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["condition", *(["variant"] if variants else []), "method", "seeds",
                     *(f"{name}_{part}" for name in names for part in ("mean", "std"))])
    for row, summary in enumerate(summaries):
        cells = [cell for _, _, column in columns for cell in ((column[row] or ("", "")))]
        writer.writerow([summary.condition, *([summary.variant or ""] if variants else []),
                         display_name(summary.condition, model, summary.variant), summary.n_seeds, *cells])
    return buffer.getvalue()
